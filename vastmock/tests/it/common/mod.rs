//! Test helpers: a tiny HTTP/1.1 client over loopback, SSH keys and logins.

#![allow(dead_code, unreachable_pub)] // Each test binary uses a different part of this module.

use serde_json::Value;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// An HTTP answer.
#[derive(Debug)]
pub struct Resp {
    pub status: u16,
    pub head: String,
    pub body: String,
}

impl Resp {
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {} {}", self.status, self.body))
    }
}

/// A client of one mock with one key.
#[derive(Debug, Clone)]
pub struct Api {
    pub addr: String,
    pub key: Option<String>,
}

impl Api {
    pub fn new(url: &str, key: &str) -> Self {
        Self {
            addr: url.strip_prefix("http://").expect("http url").to_owned(),
            key: Some(key.to_owned()),
        }
    }

    /// One request; `Err` when the connection ends without a full answer.
    pub fn try_call(
        &self,
        method: &str,
        path: &str,
        body: Option<&Value>,
    ) -> std::io::Result<Resp> {
        let mut s = TcpStream::connect(&self.addr)?;
        s.set_read_timeout(Some(Duration::from_secs(20)))?;
        let body = body.map(|b| b.to_string()).unwrap_or_default();
        let auth = match &self.key {
            Some(k) => format!("Authorization: Bearer {k}\r\n"),
            None => String::new(),
        };
        write!(
            s,
            "{method} {path} HTTP/1.1\r\nHost: {}\r\n{auth}Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            self.addr,
            body.len()
        )?;
        let mut raw = Vec::new();
        s.read_to_end(&mut raw)?;
        let raw = String::from_utf8_lossy(&raw).into_owned();
        let Some((head, body)) = raw.split_once("\r\n\r\n") else {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                format!("no complete answer: {raw:?}"),
            ));
        };
        let status = head
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .expect("status line");
        Ok(Resp {
            status,
            head: head.to_owned(),
            body: body.to_owned(),
        })
    }

    pub fn call(&self, method: &str, path: &str, body: Option<&Value>) -> Resp {
        self.try_call(method, path, body)
            .unwrap_or_else(|e| panic!("{method} {path}: {e}"))
    }

    pub fn get(&self, path: &str) -> Resp {
        self.call("GET", path, None)
    }

    pub fn put(&self, path: &str, body: Value) -> Resp {
        self.call("PUT", path, Some(&body))
    }

    pub fn post(&self, path: &str, body: Value) -> Resp {
        self.call("POST", path, Some(&body))
    }

    pub fn delete(&self, path: &str) -> Resp {
        self.call("DELETE", path, Some(&serde_json::json!({})))
    }

    /// Creates an instance on `offer` with `label`; returns its id.
    pub fn create(&self, offer: u64, label: &str) -> u64 {
        let r = self.put(
            &format!("/api/v0/asks/{offer}/"),
            serde_json::json!({"client_id": "me", "image": "ubuntu:22.04", "disk": 16.0,
                               "label": label, "runtype": "ssh_direct", "env": {}, "cancel_unavail": true}),
        );
        assert_eq!(r.status, 200, "{}", r.body);
        r.json()["new_contract"].as_u64().expect("new_contract")
    }

    /// `GET /instances/{id}/`'s `instances` field.
    pub fn show(&self, id: u64) -> Value {
        let r = self.get(&format!("/api/v0/instances/{id}/"));
        assert_eq!(r.status, 200, "{}", r.body);
        r.json()["instances"].clone()
    }

    /// Shows `id` until `actual_status` is `want` (None: null), or panics after `limit`.
    pub fn wait_status(&self, id: u64, want: Option<&str>, limit: Duration) -> Value {
        let deadline = Instant::now() + limit;
        loop {
            let row = self.show(id);
            if row["actual_status"].as_str() == want {
                return row;
            }
            assert!(
                Instant::now() < deadline,
                "instance {id} not {want:?} within {limit:?}: {row}"
            );
            std::thread::sleep(Duration::from_millis(25));
        }
    }
}

/// An ed25519 key pair made with ssh-keygen in `dir`: (private key path, public key line).
pub fn keypair(dir: &Path, name: &str) -> (PathBuf, String) {
    let private = dir.join(name);
    let out = Command::new("ssh-keygen")
        .args(["-q", "-t", "ed25519", "-N", "", "-C", name, "-f"])
        .arg(&private)
        .output()
        .expect("ssh-keygen");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let public = std::fs::read_to_string(private.with_extension("pub")).expect("public key");
    (private, public.trim().to_owned())
}

/// Runs `command` over `ssh` with `key` on 127.0.0.1:`port`: (success, stdout).
pub fn ssh(key: &Path, port: u16, command: &str) -> (bool, String) {
    ssh_to(key, "127.0.0.1", port, command)
}

/// Runs `command` over `ssh` with `key` on `host`:`port`: (success, stdout).
pub fn ssh_to(key: &Path, host: &str, port: u16, command: &str) -> (bool, String) {
    let out = Command::new("ssh")
        .args([
            "-i",
            key.to_str().expect("utf-8 path"),
            "-p",
            &port.to_string(),
            "-o",
            "StrictHostKeyChecking=no",
            "-o",
            "UserKnownHostsFile=/dev/null",
            "-o",
            "BatchMode=yes",
            "-o",
            "IdentitiesOnly=yes",
            "-o",
            "ConnectTimeout=5",
            "-o",
            "LogLevel=ERROR",
            &format!("root@{host}"),
            command,
        ])
        .output()
        .expect("ssh client (openssh-client)");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

/// The SSH proxy an instance row advertises in `ssh_host`/`ssh_port`.
pub fn proxy(row: &Value) -> Option<(String, u16)> {
    let host = row["ssh_host"].as_str()?.to_owned();
    let port = u16::try_from(row["ssh_port"].as_u64()?).ok()?;
    Some((host, port))
}

/// The SSH port an instance row advertises in `ports["22/tcp"]`.
pub fn host_port(row: &Value) -> Option<u16> {
    row["ports"]["22/tcp"][0]["HostPort"].as_str()?.parse().ok()
}

/// Live sshd processes whose configuration lies under `dir`.
pub fn sshds_under(dir: &Path) -> usize {
    let needle = dir.to_string_lossy().into_owned();
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().parse::<u32>().is_ok())
        .filter_map(|e| std::fs::read(e.path().join("cmdline")).ok())
        .map(|c| String::from_utf8_lossy(&c).replace('\0', " "))
        .filter(|c| c.contains("sshd") && c.contains(" -f ") && c.contains(&needle))
        .count()
}
