//! The crate's integration tests, gathered into one binary so that they
//! link once and share the test threads.

mod common;
mod embedding;
mod faults;
mod instance_key;
mod lifecycle;
mod listings;
mod official_client;
mod renting;
