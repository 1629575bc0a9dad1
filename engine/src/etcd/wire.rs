//! The JSON of etcd's gRPC gateway: base64 bytes, 64-bit integers as strings,
//! fields left out when they hold their zero value.

use data_encoding::BASE64;
use serde::de::{self, Deserializer};
use serde::{Deserialize, Serialize};

/// Bytes as the gateway writes them.
pub(crate) fn b64(bytes: &[u8]) -> String {
    BASE64.encode(bytes)
}

/// Bytes from the gateway's base64.
pub(crate) fn unb64(text: &str) -> Result<Vec<u8>, String> {
    BASE64
        .decode(text.as_bytes())
        .map_err(|e| format!("bad base64: {e}"))
}

/// A 64-bit integer the gateway writes as a string (or, leniently, a number).
pub(crate) fn de_i64<'de, D: Deserializer<'de>>(d: D) -> Result<i64, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Either {
        Text(String),
        Number(i64),
    }
    match Either::deserialize(d)? {
        Either::Number(n) => Ok(n),
        Either::Text(t) => t.parse().map_err(de::Error::custom),
    }
}

/// Base64 bytes.
pub(crate) fn de_bytes<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
    let text = String::deserialize(d)?;
    unb64(&text).map_err(de::Error::custom)
}

/// Every response's header.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct Header {
    #[serde(default, deserialize_with = "de_i64")]
    pub(crate) revision: i64,
}

/// An error answer: `{"error": …, "message": …, "code": n}` (gRPC codes).
#[derive(Debug, Deserialize)]
pub(crate) struct ErrorBody {
    #[serde(default)]
    pub(crate) message: String,
    #[serde(default)]
    pub(crate) error: String,
    #[serde(default)]
    pub(crate) code: i32,
}

/// One key as the gateway writes it.
#[derive(Debug, Deserialize)]
pub(crate) struct WireKv {
    #[serde(default, deserialize_with = "de_bytes")]
    pub(crate) key: Vec<u8>,
    #[serde(default, deserialize_with = "de_bytes")]
    pub(crate) value: Vec<u8>,
    #[serde(default, deserialize_with = "de_i64")]
    pub(crate) create_revision: i64,
    #[serde(default, deserialize_with = "de_i64")]
    pub(crate) mod_revision: i64,
    #[serde(default, deserialize_with = "de_i64")]
    pub(crate) version: i64,
    #[serde(default, deserialize_with = "de_i64")]
    pub(crate) lease: i64,
}

#[derive(Debug, Default, Deserialize)]
pub(crate) struct RangeBody {
    #[serde(default)]
    pub(crate) header: Header,
    #[serde(default)]
    pub(crate) kvs: Vec<WireKv>,
    #[serde(default)]
    pub(crate) more: bool,
    #[serde(default, deserialize_with = "de_i64")]
    pub(crate) count: i64,
}

#[derive(Debug, Default, Deserialize)]
pub(crate) struct PutBody {
    #[serde(default)]
    pub(crate) header: Header,
}

#[derive(Debug, Default, Deserialize)]
pub(crate) struct DeleteBody {
    #[serde(default, deserialize_with = "de_i64")]
    pub(crate) deleted: i64,
}

#[derive(Debug, Default, Deserialize)]
pub(crate) struct OpBody {
    #[serde(default)]
    pub(crate) response_range: Option<RangeBody>,
    #[serde(default)]
    pub(crate) response_delete_range: Option<DeleteBody>,
}

#[derive(Debug, Default, Deserialize)]
pub(crate) struct TxnBody {
    #[serde(default)]
    pub(crate) header: Header,
    #[serde(default)]
    pub(crate) succeeded: bool,
    #[serde(default)]
    pub(crate) responses: Vec<OpBody>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub(crate) struct LeaseBody {
    #[serde(default, rename = "ID", deserialize_with = "de_i64")]
    pub(crate) id: i64,
    #[serde(default, rename = "TTL", deserialize_with = "de_i64")]
    pub(crate) ttl: i64,
    #[serde(default)]
    pub(crate) error: String,
}

/// A streamed answer (`/v3/lease/keepalive`): one `result`, or an `error`.
#[derive(Debug, Deserialize)]
pub(crate) struct StreamBody<T> {
    pub(crate) result: Option<T>,
    pub(crate) error: Option<serde_json::Value>,
}

#[derive(Debug, Deserialize)]
pub(crate) struct AuthBody {
    #[serde(default)]
    pub(crate) token: String,
}

/// `/v3/auth/authenticate`'s request.
#[derive(Serialize)]
pub(crate) struct AuthRequest<'a> {
    pub(crate) name: &'a str,
    pub(crate) password: &'a str,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integers_come_as_strings_and_zero_values_are_left_out() {
        let body: RangeBody = serde_json::from_str(
            r#"{"header":{"revision":"7"},"kvs":[{"key":"Zm9v","create_revision":"2","mod_revision":"5","version":"2","value":"YmFy"}],"count":"1"}"#,
        )
        .unwrap();
        assert_eq!(body.header.revision, 7);
        assert_eq!(body.count, 1);
        assert!(!body.more);
        let kv = &body.kvs[0];
        assert_eq!(
            (kv.key.as_slice(), kv.value.as_slice()),
            (&b"foo"[..], &b"bar"[..])
        );
        assert_eq!(
            (kv.create_revision, kv.mod_revision, kv.version, kv.lease),
            (2, 5, 2, 0)
        );
        let txn: TxnBody = serde_json::from_str(r#"{"header":{"revision":"3"}}"#).unwrap();
        assert!(!txn.succeeded);
    }
}
