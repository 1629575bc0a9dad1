//! The daemon crate's integration tests, gathered into one binary.

// Tests own their processes and real time.
#![allow(clippy::disallowed_methods, clippy::disallowed_types)]

mod embed;
mod etcd_journal;
mod journal_model;
