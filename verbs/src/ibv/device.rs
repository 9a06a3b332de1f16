//! Devices: listing them.

use super::*;
use std::ffi::{CStr, c_int};
use std::ptr::NonNull;

use ibverbs_sys as ffi;

/// An RDMA device as listed by `ibv_get_device_list`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Kernel name, e.g. `rxe0`, `mlx5_0`.
    pub name: String,
    /// Node GUID in host byte order.
    pub guid: u64,
}

impl DeviceInfo {
    /// The GUID the way `ibv_devices` prints it (16 hex digits).
    pub fn guid_hex(&self) -> String {
        format!("{:016x}", self.guid)
    }
}

/// The array returned by `ibv_get_device_list`, freed on drop.
pub(crate) struct DeviceList {
    pub(crate) list: NonNull<*mut ffi::ibv_device>,
    pub(crate) len: usize,
}

impl DeviceList {
    pub(crate) fn get() -> Result<DeviceList> {
        let mut num: c_int = 0;
        // SAFETY: `num` is a valid out-pointer; the call has no other preconditions.
        let list = unsafe { ffi::ibv_get_device_list(&mut num) };
        let Some(list) = NonNull::new(list) else {
            let err = null_error();
            return Err(if err.raw_os_error() == Some(38) {
                VerbsError::NoKernelSupport {
                    op: "ibv_get_device_list",
                    source: err,
                }
            } else {
                VerbsError::Verbs {
                    op: "ibv_get_device_list",
                    device: "(none)".into(),
                    source: err,
                }
            });
        };
        let list = DeviceList {
            list,
            len: usize::try_from(num).unwrap_or(0),
        };
        if list.len == 0 {
            return Err(VerbsError::NoDevice);
        }
        Ok(list)
    }

    pub(crate) fn devices(&self) -> impl Iterator<Item = *mut ffi::ibv_device> + '_ {
        // SAFETY: libibverbs returns an array of `len` valid device pointers (followed by a
        // NULL) that stays valid until `ibv_free_device_list`, i.e. while `self` lives.
        (0..self.len).map(|i| unsafe { *self.list.as_ptr().add(i) })
    }

    pub(crate) fn info(dev: *mut ffi::ibv_device) -> DeviceInfo {
        // SAFETY: `dev` comes from a live device list; the name is a NUL-terminated string
        // owned by the device structure, copied out before the list is freed.
        let name = unsafe { CStr::from_ptr(ffi::ibv_get_device_name(dev)) }
            .to_string_lossy()
            .into_owned();
        // SAFETY: `dev` comes from a live device list.
        let guid = u64::from_be(unsafe { ffi::ibv_get_device_guid(dev) });
        DeviceInfo { name, guid }
    }
}

impl Drop for DeviceList {
    fn drop(&mut self) {
        // SAFETY: the pointer came from `ibv_get_device_list` and is freed exactly once.
        // Contexts opened from it stay valid (see ibv_get_device_list(3)).
        unsafe { ffi::ibv_free_device_list(self.list.as_ptr()) }
    }
}

/// Lists the RDMA devices of this machine.
///
/// Fails with [`VerbsError::NoKernelSupport`] when the kernel has no RDMA at all and with
/// [`VerbsError::NoDevice`] when it has but no device exists.
pub fn devices() -> Result<Vec<DeviceInfo>> {
    let list = DeviceList::get()?;
    Ok(list.devices().map(DeviceList::info).collect())
}
