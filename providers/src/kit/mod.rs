//! What every provider needs to run bootstrap sessions, written once: the
//! per-key locks, the registry of open session streams, the ring of an
//! agent's recent output and the agent's line protocol.
//!
//! Each piece holds state only while it is in use: a key's lock is
//! forgotten once no call holds or awaits it, and a session's entry once
//! its stream ends. So nothing here grows with the number of sessions a
//! provider has ever started.

mod locks;
mod protocol;
mod recent;
mod sessions;

pub(crate) use locks::{KeyGuard, KeyLocks};
pub use protocol::{AGENT_LINE_PREFIX, format_agent_line, parse_agent_line};
pub(crate) use recent::RecentOutput;
pub(crate) use sessions::Sessions;
