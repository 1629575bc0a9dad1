//! The crate's integration tests, gathered into one binary so that they
//! link once and share the test threads.

mod battery;
mod cli;
mod common;
mod crash;
mod daemon_lock;
mod dashboard;
mod docker;
mod durable;
mod e2e;
mod flight;
mod gang;
mod ha;
mod health;
mod jobs;
mod lifetime;
mod orphan;
mod pause;
mod remote;
mod restart;
mod rollout;
mod scripts;
mod security;
mod ssh;
mod stall;
mod supervision;
mod swarm;
mod vast;
