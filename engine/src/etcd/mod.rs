//! etcd as a store for the journal: a v3 client over etcd's JSON gateway,
//! and a journal kept under one key prefix, committed in single fenced
//! transactions.
//!
//! The client speaks the gateway every etcd member serves on its client
//! port (`POST /v3/kv/range`, `/v3/kv/txn`, `/v3/lease/…`), so it needs no
//! generated gRPC code (and no `protoc` to build). [`EtcdStore`] keeps the
//! same contents as the redb [`crate::journal::Journal`]; `docs/ha.md`
//! describes its layout, fencing and limits.

mod client;
mod config;
mod election;
mod error;
mod store;
#[cfg(any(test, feature = "etcd-testing"))]
pub mod testing;
mod wire;

pub use client::{
    Client, Compare, KeyValue, Lease, Op, OpResponse, RESPONSE_LEN_MAX_BYTES, Range, RangePage,
    Relation, Target, Txn, TxnResponse, prefix_end,
};
pub use config::{
    CACERT_ENV, CALL_TIMEOUT_DEFAULT, CERT_ENV, Credentials, ENDPOINTS_ENV, ENDPOINTS_MAX,
    EtcdConfig, EtcdFlags, KEY_ENV, PASSWORD_ENV, REQUEST_TIMEOUT_DEFAULT, TlsFiles, USER_ENV,
};
pub use election::{Election, ElectionConfig, Role};
pub use error::EtcdError;
pub use store::{BUCKETS, EtcdStore, EtcdStoreError, Fence, LAYOUT, Limits, bucket_of};

#[cfg(test)]
mod tests;
