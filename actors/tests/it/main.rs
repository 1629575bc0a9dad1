//! The crate's integration tests, gathered into one binary so that they
//! link once and share the test threads.

mod cluster;
mod conformance;
mod embed;
mod flight;
mod glance;
mod scale;
