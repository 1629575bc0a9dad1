//! Swactor's jobs core: every decision about a job, as plain data.
//!
//! Like `swactor-provisioning`, this crate holds no clock, does no I/O and
//! starts nothing: its `clippy.toml` is the same policy list, and time is an
//! argument. The daemon's job actors drive it and perform what it decides.
//!
//! ```text
//! admission  whether a job may be accepted, and for which nodes
//! queue      which waiting jobs start now, where, and why the others wait
//! gang       what each rank of a gang is told, and what a job does next
//! machine    what one (job, node) run does next, and how a job's timeout runs
//! record     the records of jobs and runs, and what `swactor run` is told
//! wire       swactor/jobs/0 frames, the workspace manifest, the output log
//! ```

pub mod admission;
pub mod gang;
pub mod machine;
// The same deliberate violations as swactor-provisioning's, compiled into
// this crate so its own clippy.toml is shown to reject them here too.
#[cfg(swactor_policy_probe)]
#[path = "../../provisioning/src/policy_probe.rs"]
mod policy_probe;
pub mod queue;
pub mod record;
pub mod wire;
