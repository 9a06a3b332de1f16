//! The buffer pool a sender proposes upstream (`rdmasink`, and the `sender` binary's
//! `appsink` through [`super::LaunchSource`]): every buffer's memory is the payload area of one
//! send block, reserved from the core sender ([`rdmastream::engine::Reservation`]), so upstream
//! writes the frame straight into memory the transport sends from. The sink marks a buffer of
//! this pool with its frame's metadata ([`Outstanding::mark`]); the block is committed (header
//! and seal written around the payload in place, on the thread that lets the memory go when the
//! filling thread has nothing to do for the frame, else by the filling thread) once the
//! buffer's memory is let go, and given back unsent if it never was marked (a flush). Buffers
//! are never recycled: each holds its block only until it is sent.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use gst::glib;
use gst::prelude::*;
use gst::subclass::prelude::*;

use rdmastream::engine::sender::DROP_OLDEST_PATIENCE;
use rdmastream::engine::{DeviceInput, DropPolicy, FrameMeta, NotReserved, Reservation};

/// Where a pool's blocks come from: one device of a sender.
pub trait BlockLease: Send + Sync + 'static {
    /// How many in-place blocks the sender has (0: none, every acquire gets a plain buffer).
    fn in_place_blocks(&self) -> usize;
    /// Takes a free in-place block for `len` bytes, waiting up to `timeout`
    /// ([`DeviceInput::reserve`]).
    fn reserve(&self, len: usize, timeout: Duration) -> Result<Reservation, NotReserved>;
    /// Hands a block written in place on ([`Reservation::commit`]). The pool's memories call
    /// it through their lease, which they hold until then.
    fn commit(&self, reservation: Reservation, meta: FrameMeta) -> bool {
        reservation.commit(meta)
    }
}

impl BlockLease for DeviceInput {
    fn in_place_blocks(&self) -> usize {
        DeviceInput::in_place_blocks(self)
    }

    fn reserve(&self, len: usize, timeout: Duration) -> Result<Reservation, NotReserved> {
        DeviceInput::reserve(self, len, timeout)
    }
}

/// What the sink (`rdmasink`'s `render`, the binary's appsink probe) decided about a pooled
/// buffer's frame.
#[derive(Default)]
enum SlotState {
    /// Not rendered yet: let go like this, the block is given back.
    #[default]
    Open,
    /// Rendered: commit with this metadata when the memory is let go.
    Commit(FrameMeta),
    /// Committed (or rendered once already): a second render copies.
    Taken,
}

/// The pooled memories not yet let go, by the address of their payload (how `render`
/// recognises a buffer of this pool without any unsafe meta or qdata): their length, whether
/// they are the receiver's memory itself (shm), and their slot.
#[derive(Default)]
pub struct Outstanding(Mutex<HashMap<usize, (usize, bool, Slot)>>);

/// What `render` decided about one pooled memory, shared with the memory itself.
type Slot = Arc<Mutex<SlotState>>;

impl Outstanding {
    /// Marks the pooled memory at `addr` of `len` bytes to be sent with `meta` once let go.
    /// `None` when it is not one of ours (or was rendered already): the caller copies;
    /// otherwise whether it is a block of the receiver's memory itself.
    pub fn mark(&self, addr: usize, len: usize, meta: FrameMeta) -> Option<bool> {
        let (reserved, remote, slot) = self.0.lock().unwrap().get(&addr).cloned()?;
        let mut state = slot.lock().unwrap();
        match &*state {
            // A buffer resized after it was acquired is copied: the block holds `reserved`.
            SlotState::Open if len == reserved => {
                *state = SlotState::Commit(meta);
                Some(remote)
            }
            _ => None,
        }
    }

    /// Marks `buffer` (see [`Outstanding::mark`]) when it is one memory of this pool that
    /// nothing but the caller holds: a buffer something else still holds (a `tee`'s other
    /// branch, a `videorate` about to push it again) would have its commit wait for that
    /// holder, and a later frame overtake it. `None`: the caller copies.
    pub fn mark_buffer(&self, buffer: &gst::Buffer, meta: FrameMeta) -> Option<bool> {
        if buffer.n_memory() != 1 || !buffer.is_writable() || !buffer.is_all_memory_writable() {
            return None;
        }
        let map = buffer.map_readable().ok()?;
        self.mark(map.as_ptr() as usize, map.len(), meta)
    }
}

/// A buffer's memory: the reservation of one send block.
struct BlockMemory {
    reservation: Option<Reservation>,
    slot: Arc<Mutex<SlotState>>,
    outstanding: Arc<Outstanding>,
    addr: usize,
    lease: Arc<dyn BlockLease>,
}

impl AsMut<[u8]> for BlockMemory {
    fn as_mut(&mut self) -> &mut [u8] {
        self.reservation
            .as_mut()
            .expect("held until drop")
            .payload_mut()
    }
}

impl Drop for BlockMemory {
    fn drop(&mut self) {
        self.outstanding.0.lock().unwrap().remove(&self.addr);
        let state = std::mem::replace(&mut *self.slot.lock().unwrap(), SlotState::Taken);
        if let (SlotState::Commit(meta), Some(r)) = (state, self.reservation.take()) {
            self.lease.commit(r, meta);
        }
        // Otherwise the reservation drops here: its block goes back unsent.
    }
}

/// The element's check of its link, run while a buffer waits for a free send block: it posts
/// the element's error (an unreachable receiver past `reconnect-timeout`, a refusal) and says
/// whether to go on.
pub type LinkCheck = Arc<dyn Fn() -> Result<(), gst::FlowError> + Send + Sync>;

/// Says that upstream wanted more buffers at once (the first number) than the sender has
/// in-place blocks (the second), and what to set: an element's warning, a log line.
pub type Warn = Arc<dyn Fn(u32, u32) + Send + Sync>;

/// Whether an acquire waits for a free block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Wait {
    /// Waits (upstream waits with it: a lossless or blocking device), checking the link every
    /// 100 ms.
    ForABlock,
    /// Waits a moment for a block ([`DROP_OLDEST_PATIENCE`]), then hands out a plain buffer,
    /// which the sink copies (a lossy live device: upstream is never held up by the link for
    /// longer than that).
    AMoment,
}

impl Wait {
    /// How a device with `policy` waits: a lossless one for a block, a live one a moment.
    pub fn for_policy(policy: DropPolicy) -> Wait {
        match policy {
            DropPolicy::Block => Wait::ForABlock,
            DropPolicy::DropOldest => Wait::AMoment,
        }
    }
}

pub struct BlockPoolImp {
    lease: Mutex<Option<Arc<dyn BlockLease>>>,
    check: Mutex<Option<LinkCheck>>,
    warn: Mutex<Option<Warn>>,
    wait: Mutex<Wait>,
    outstanding: Arc<Outstanding>,
    flushing: AtomicBool,
}

impl Default for BlockPoolImp {
    fn default() -> BlockPoolImp {
        BlockPoolImp {
            lease: Mutex::default(),
            check: Mutex::default(),
            warn: Mutex::default(),
            wait: Mutex::new(Wait::ForABlock),
            outstanding: Arc::default(),
            flushing: AtomicBool::new(false),
        }
    }
}

#[glib::object_subclass]
impl ObjectSubclass for BlockPoolImp {
    const NAME: &'static str = "RdmastreamSendBlockPool";
    type Type = BlockPool;
    type ParentType = gst::BufferPool;
}

impl ObjectImpl for BlockPoolImp {}
impl GstObjectImpl for BlockPoolImp {}

impl BufferPoolImpl for BlockPoolImp {
    /// Refuses a configuration that wants more buffers out at once (its minimum) than the
    /// sender has in-place blocks: an acquire past them waits for a block that only a buffer
    /// upstream still holds can give back. `v4l2src io-mode=userptr` asks for 4 (with `vivid`)
    /// and queues buffers to the driver before it dequeues any: with 2 blocks it waited for
    /// ever. Refused, it reads the lowered configuration back, finds it short and fails with an
    /// error at once, and the element's warning says what to set. A pool that waits only a
    /// moment ([`Wait::AMoment`]) takes any minimum: past its blocks it hands out plain buffers.
    fn set_config(&self, config: &mut gst::BufferPoolConfigRef) -> bool {
        let blocks = self
            .lease
            .lock()
            .unwrap()
            .as_ref()
            .map_or(0, |l| l.in_place_blocks());
        let waits = *self.wait.lock().unwrap() == Wait::ForABlock;
        if let Some((caps, size, min, max)) = config.params()
            && waits
            && blocks > 0
            && min as usize > blocks
        {
            let blocks = blocks as u32;
            if let Some(warn) = self.warn.lock().unwrap().clone() {
                warn(min, blocks);
            }
            let max = if max == 0 { blocks } else { max.min(blocks) };
            config.set_params(caps.as_ref(), size, blocks, max);
            self.parent_set_config(config);
            return false;
        }
        self.parent_set_config(config)
    }

    fn acquire_buffer(
        &self,
        _params: Option<&gst::BufferPoolAcquireParams>,
    ) -> Result<gst::Buffer, gst::FlowError> {
        let size = self
            .obj()
            .config()
            .params()
            .map_or(0, |(_, size, _, _)| size as usize);
        let wait = *self.wait.lock().unwrap();
        let timeout = match wait {
            Wait::ForABlock => Duration::from_millis(100),
            Wait::AMoment => DROP_OLDEST_PATIENCE,
        };
        loop {
            if self.flushing.load(Ordering::Acquire) {
                return Err(gst::FlowError::Flushing);
            }
            let Some(lease) = self.lease.lock().unwrap().clone() else {
                return Err(gst::FlowError::Flushing);
            };
            match lease.reserve(size, timeout) {
                Ok(mut r) => {
                    let addr = r.payload_mut().as_ptr() as usize;
                    let slot = Arc::new(Mutex::new(SlotState::Open));
                    self.outstanding
                        .0
                        .lock()
                        .unwrap()
                        .insert(addr, (r.len(), r.is_remote(), slot.clone()));
                    let memory = gst::Memory::from_mut_slice(BlockMemory {
                        reservation: Some(r),
                        slot,
                        outstanding: self.outstanding.clone(),
                        addr,
                        lease,
                    });
                    let mut buffer = gst::Buffer::new();
                    buffer.get_mut().expect("new buffer").append_memory(memory);
                    return Ok(buffer);
                }
                // None came free in a moment: a plain buffer, copied.
                Err(NotReserved::TimedOut) if wait == Wait::AMoment => {
                    return gst::Buffer::with_size(size).map_err(|_| gst::FlowError::Error);
                }
                // No block came free: the receiver may be gone for good (every block then
                // waits for it), which only the element's check notices; without it upstream
                // would wait here for ever and `reconnect-timeout` never fire.
                Err(NotReserved::TimedOut) => {
                    let check = self.check.lock().unwrap().clone();
                    if let Some(check) = check {
                        check()?;
                    }
                }
                Err(NotReserved::Stopped) => return Err(gst::FlowError::Flushing),
                // Too large for one block, or no in-place blocks: an ordinary buffer,
                // which `render` copies.
                Err(NotReserved::TooLarge | NotReserved::Unavailable) => {
                    return gst::Buffer::with_size(size).map_err(|_| gst::FlowError::Error);
                }
            }
        }
    }

    fn release_buffer(&self, buffer: gst::Buffer) {
        // Never recycled: dropping it lets the memory go, which commits or frees its block.
        drop(buffer);
    }

    fn start(&self) -> bool {
        true
    }

    fn stop(&self) -> bool {
        true
    }

    fn flush_start(&self) {
        self.flushing.store(true, Ordering::Release);
    }

    fn flush_stop(&self) {
        self.flushing.store(false, Ordering::Release);
    }
}

glib::wrapper! {
    pub struct BlockPool(ObjectSubclass<BlockPoolImp>) @extends gst::BufferPool, gst::Object;
}

impl BlockPool {
    /// A pool reserving blocks on `lease`'s device; `check` runs whenever a buffer has waited
    /// 100 ms for a block, and its error ends the wait; `warn` says why a configuration was
    /// refused.
    pub fn new(lease: Arc<dyn BlockLease>, wait: Wait, check: LinkCheck, warn: Warn) -> BlockPool {
        let pool: BlockPool = glib::Object::new();
        *pool.imp().lease.lock().unwrap() = Some(lease);
        *pool.imp().wait.lock().unwrap() = wait;
        *pool.imp().check.lock().unwrap() = Some(check);
        *pool.imp().warn.lock().unwrap() = Some(warn);
        pool
    }

    /// The most buffers to propose upstream: the sender's in-place blocks for a pool that
    /// waits (`set_config` refuses more); 0, no limit, for one that waits a moment (past its
    /// blocks it hands out plain buffers).
    pub fn max_buffers(&self) -> u32 {
        match *self.imp().wait.lock().unwrap() {
            Wait::AMoment => 0,
            Wait::ForABlock => self.imp().lease.lock().unwrap().as_ref().map_or(0, |l| {
                u32::try_from(l.in_place_blocks()).unwrap_or(u32::MAX)
            }),
        }
    }

    /// The memories of this pool not yet let go.
    pub fn outstanding(&self) -> Arc<Outstanding> {
        self.imp().outstanding.clone()
    }

    /// The element stopped: no more reservations (outstanding ones are let go with their
    /// buffers).
    pub fn detach(&self) {
        self.imp().lease.lock().unwrap().take();
        self.imp().check.lock().unwrap().take();
        self.imp().warn.lock().unwrap().take();
    }
}
