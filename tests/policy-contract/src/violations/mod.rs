//! One module per way around the policy; each must be caught.

pub mod handle_spawn;
pub mod interval;
pub mod joinset_spawn;
pub mod ractor_spawn;
pub mod reexport;
pub mod renamed_import;
pub mod spawn_blocking;
pub mod system_time;
pub mod thread_builder;
pub mod timeout;
pub mod tokio_instant;
