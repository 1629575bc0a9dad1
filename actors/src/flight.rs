//! The driver's recorded frames (`swactor_provisioning::flight`) as the
//! engine's flight writer takes them: the host keeps its results and
//! observations in a compact form, and the writer thread encodes them, off
//! the thread that runs the driver.

use crate::driver::FLIGHT_FLUSH_AT;
use swactor_engine::flight::FlightChunk;
use swactor_provisioning::flight::FlightBatch;

/// A driver's flight recorder (see `swactor_engine::flight`).
pub type FlightRecorder = swactor_engine::flight::FlightRecorder<FlightFrames>;

/// What a new chunk has room for: what the driver hands over at once in a
/// busy message ([`FLIGHT_FLUSH_AT`]), and the largest result or
/// observation kept compact more (about 800 bytes), so that it never grows
/// on the way (growing copies what it holds).
const ROOM: usize = FLIGHT_FLUSH_AT + (1 << 10);

/// The largest chunk kept for reuse.
const CAPACITY_MAX: usize = 4 << 20;

/// One flush of the host's frames.
#[derive(Debug, Default)]
pub struct FlightFrames(pub(crate) FlightBatch);

impl FlightChunk for FlightFrames {
    fn with_room() -> Self {
        Self(FlightBatch::with_room(ROOM))
    }

    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    fn held(&self) -> u64 {
        self.0.held() as u64
    }

    fn write_to(&self, out: &mut Vec<u8>) {
        self.0.write_to(out);
    }

    fn recycle(&mut self) -> bool {
        self.0.clear();
        self.0.capacity() <= CAPACITY_MAX
    }
}
