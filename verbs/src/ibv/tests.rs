//! Unit tests of the safe verbs layer that need no device.

use super::*;
use ibverbs_sys as ffi;
use std::net::Ipv6Addr;

fn entry(index: u32, gid: &str, gid_type: GidType) -> GidEntry {
    GidEntry {
        index,
        gid: Gid(gid.parse::<Ipv6Addr>().unwrap().octets()),
        gid_type,
    }
}

/// The table rxe shows for a netdev with 192.0.2.1 and an IPv6 link-local address.
fn rxe_table() -> Vec<GidEntry> {
    vec![
        entry(0, "fe80::5054:ff:fe12:3456", GidType::RoceV1),
        entry(1, "fe80::5054:ff:fe12:3456", GidType::RoceV2),
        entry(2, "::ffff:192.0.2.1", GidType::RoceV1),
        entry(3, "::ffff:192.0.2.1", GidType::RoceV2),
    ]
}

#[test]
fn roce_prefers_v2_ipv4_mapped() {
    let got = choose_gid(&rxe_table(), LinkLayer::Ethernet, None).unwrap();
    assert_eq!(got.index, 3);
    assert_eq!(got.gid.to_string(), "::ffff:192.0.2.1");
}

#[test]
fn roce_without_ipv4_takes_v2_link_local() {
    let table = &rxe_table()[..2];
    assert_eq!(
        choose_gid(table, LinkLayer::Ethernet, None).unwrap().index,
        1
    );
}

#[test]
fn roce_v2_global_ipv6_beats_v1_ipv4() {
    let table = vec![
        entry(0, "::ffff:10.0.0.1", GidType::RoceV1),
        entry(5, "2001:db8::1", GidType::RoceV2),
    ];
    assert_eq!(
        choose_gid(&table, LinkLayer::Ethernet, None).unwrap().index,
        5
    );
}

#[test]
fn ties_go_to_lowest_index() {
    let table = vec![
        entry(7, "::ffff:192.0.2.2", GidType::RoceV2),
        entry(4, "::ffff:192.0.2.1", GidType::RoceV2),
    ];
    assert_eq!(
        choose_gid(&table, LinkLayer::Ethernet, None).unwrap().index,
        4
    );
}

#[test]
fn explicit_index_overrides_and_must_exist() {
    let table = rxe_table();
    assert_eq!(
        choose_gid(&table, LinkLayer::Ethernet, Some(0))
            .unwrap()
            .index,
        0
    );
    assert_eq!(choose_gid(&table, LinkLayer::Ethernet, Some(9)), None);
}

#[test]
fn infiniband_takes_lowest_index() {
    let table = vec![
        entry(1, "fe80::2", GidType::Ib),
        entry(0, "fe80::1", GidType::Ib),
    ];
    assert_eq!(
        choose_gid(&table, LinkLayer::InfiniBand, None)
            .unwrap()
            .index,
        0
    );
    assert_eq!(choose_gid(&[], LinkLayer::Ethernet, None), None);
}

#[test]
fn gid_classification() {
    let g = |s: &str| Gid(s.parse::<Ipv6Addr>().unwrap().octets());
    assert!(g("fe80::1").is_link_local());
    assert!(!g("fe80::1").is_ipv4_mapped());
    assert!(g("::ffff:192.0.2.1").is_ipv4_mapped());
    assert!(!g("::ffff:192.0.2.1").is_link_local());
    assert!(g("::").is_zero());
}

#[test]
fn endpoint_round_trips() {
    let ep = QpEndpoint {
        qpn: 0x11,
        psn: 0xab_cdef,
        lid: 7,
        gid: Gid([0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 192, 0, 2, 1]),
    };
    let bytes = ep.to_bytes();
    assert_eq!(QpEndpoint::from_bytes(&bytes).unwrap(), ep);
    assert!(QpEndpoint::from_bytes(&bytes[..25]).is_err());
    let mut bad = bytes;
    bad[0] = 0x01; // qpn > 24 bits
    assert!(QpEndpoint::from_bytes(&bad).is_err());
}

#[test]
fn access_flags_compose() {
    let rw = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE;
    assert!(rw.contains(AccessFlags::REMOTE_WRITE));
    assert!(!rw.contains(AccessFlags::REMOTE_READ));
    assert!(rw.remotely_writable());
    assert!(!AccessFlags::REMOTE_READ.remotely_writable());
    assert_eq!(format!("{rw:?}"), "LOCAL_WRITE|REMOTE_WRITE");
    assert_eq!(format!("{:?}", AccessFlags::NONE), "NONE");
}

#[test]
fn page_buf_is_aligned_zeroed_and_rounded() {
    let buf = PageBuf::zeroed(10).unwrap();
    assert_eq!(buf.ptr.as_ptr() as usize % REGION_ALIGN, 0);
    assert_eq!(buf.layout.size(), REGION_ALIGN);
    // SAFETY: the buffer holds `layout.size()` initialised bytes.
    let bytes = unsafe { std::slice::from_raw_parts(buf.ptr.as_ptr(), buf.layout.size()) };
    assert!(bytes.iter().all(|&b| b == 0));
    assert!(PageBuf::zeroed(0).is_err());
}

#[test]
fn status_text_comes_from_libibverbs() {
    assert_eq!(
        wc_status_text(ffi::ibv_wc_status::IBV_WC_SUCCESS),
        "success"
    );
    assert_eq!(
        wc_status_text(ffi::ibv_wc_status::IBV_WC_REM_ACCESS_ERR),
        "remote access error"
    );
}

/// On a kernel without RDMA (this project's build host) the error must say so.
#[test]
fn device_list_error_is_clear() {
    match devices() {
        Ok(list) => assert!(!list.is_empty()),
        Err(e @ VerbsError::NoKernelSupport { .. }) => {
            assert!(e.to_string().contains("no RDMA support"), "{e}");
        }
        Err(VerbsError::NoDevice) => {}
        Err(e) => panic!("unexpected error: {e}"),
    }
    if let Err(e) = Context::open(Some("no_such_dev0")) {
        let msg = e.to_string();
        assert!(
            msg.contains("no_such_dev0") || msg.contains("no RDMA"),
            "{msg}"
        );
    }
}
