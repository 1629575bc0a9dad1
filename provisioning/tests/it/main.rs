//! The crate's integration tests, gathered into one binary so that they
//! link once and share the test threads.

mod adoption;
mod alloc;
mod apply_next;
mod burst;
mod common;
mod contracts;
mod deaf;
mod departed;
mod diff;
mod driver;
mod failure_cause;
mod failures;
mod given_up;
mod ladder;
mod lanes;
mod leadership;
mod lease;
mod lifetime;
mod next_step;
mod pause;
mod preempt;
mod properties;
mod readiness;
mod replace;
mod rollout;
mod spent;
