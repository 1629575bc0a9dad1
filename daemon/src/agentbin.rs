//! Which binary remote machines run as their agent.
//!
//! Providers that bootstrap over SSH upload a swactor binary to each host and
//! run its `agent` subcommand there. In order, the daemon takes:
//!
//! 1. the path given with `--agent-binary` (or `$SWACTOR_AGENT_BINARY`),
//!    which must exist;
//! 2. `swactor-agent` next to its own executable, which
//!    `scripts/build-static-agent.sh` leaves there;
//! 3. its own executable.
//!
//! A statically linked binary runs on any Linux host of the same
//! architecture; a dynamically linked one needs a C library at least as new
//! as this machine's, so the daemon says so when it falls back to one.

use anyhow::{Context, Result, bail};
use std::path::{Path, PathBuf};

/// The file remote hosts run as their agent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AgentBinary {
    /// Where it is.
    pub path: PathBuf,
    /// Whether it needs no dynamic loader (a static or static-pie binary).
    pub static_linked: bool,
    /// How it was found, for messages.
    pub found: &'static str,
}

/// Name of the static agent next to the swactor executable.
pub const STATIC_AGENT_NAME: &str = "swactor-agent";

impl AgentBinary {
    /// Finds the agent binary (see the module docs).
    ///
    /// # Errors
    /// The configured path is missing or not a regular file, or no binary
    /// can be found at all.
    pub fn find(configured: Option<&Path>) -> Result<Self> {
        if let Some(path) = configured {
            let meta = std::fs::metadata(path).with_context(|| {
                format!(
                    "the agent binary {} (--agent-binary or $SWACTOR_AGENT_BINARY) cannot be read",
                    path.display()
                )
            })?;
            if !meta.is_file() {
                bail!("the agent binary {} is not a file", path.display());
            }
            return Self::at(path.to_path_buf(), "as configured");
        }
        let own = std::env::current_exe().context("cannot find the swactor executable")?;
        if let Some(dir) = own.parent() {
            let next = dir.join(STATIC_AGENT_NAME);
            if next.is_file() {
                return Self::at(next, "next to the swactor executable");
            }
        }
        Self::at(own, "the daemon's own executable")
    }

    fn at(path: PathBuf, found: &'static str) -> Result<Self> {
        let static_linked = is_static(&path)
            .with_context(|| format!("cannot read the agent binary {}", path.display()))?;
        Ok(Self {
            path,
            static_linked,
            found,
        })
    }

    /// A warning for a binary that needs a dynamic loader, if this is one.
    pub fn warning(&self) -> Option<String> {
        (!self.static_linked).then(|| {
            format!(
                "remote hosts will run {} ({}), which is dynamically linked: it runs only \
                 where the C library is at least as new as here. Build a static agent with \
                 scripts/build-static-agent.sh, or name one with --agent-binary",
                self.path.display(),
                self.found
            )
        })
    }
}

/// Whether the ELF file at `path` has no program interpreter (`PT_INTERP`),
/// i.e. runs without a dynamic loader. A file that is not a 64-bit
/// little-endian ELF counts as not static.
fn is_static(path: &Path) -> std::io::Result<bool> {
    use std::io::{Read, Seek, SeekFrom};
    const PT_INTERP: u32 = 3;
    let mut f = std::fs::File::open(path)?;
    let mut header = [0u8; 64];
    if f.read_exact(&mut header).is_err() {
        return Ok(false);
    }
    // Magic, 64-bit class, little-endian.
    if &header[..4] != b"\x7fELF" || header[4] != 2 || header[5] != 1 {
        return Ok(false);
    }
    let u16_at = |o: usize| u16::from_le_bytes([header[o], header[o + 1]]);
    let mut phoff = [0u8; 8];
    phoff.copy_from_slice(&header[0x20..0x28]);
    let phoff = u64::from_le_bytes(phoff);
    let (entry_len, count) = (u64::from(u16_at(0x36)), u16_at(0x38));
    let mut entry = [0u8; 4];
    for i in 0..u64::from(count) {
        f.seek(SeekFrom::Start(phoff + i * entry_len))?;
        f.read_exact(&mut entry)?;
        if u32::from_le_bytes(entry) == PT_INTERP {
            return Ok(false);
        }
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_dynamically_linked_test_binary_is_told_apart_from_a_non_elf_file() {
        // This test binary is built the normal way: it has an interpreter.
        let own = std::env::current_exe().unwrap();
        assert!(!is_static(&own).unwrap());
        let dir = tempfile::tempdir().unwrap();
        let script = dir.path().join("agent.sh");
        std::fs::write(&script, "#!/bin/sh\n").unwrap();
        assert!(!is_static(&script).unwrap());
        let found = AgentBinary::find(Some(&script)).unwrap();
        assert_eq!(found.found, "as configured");
        assert!(found.warning().unwrap().contains("build-static-agent.sh"));
        let missing = AgentBinary::find(Some(&dir.path().join("nope"))).unwrap_err();
        assert!(
            format!("{missing:#}").contains("cannot be read"),
            "{missing:#}"
        );
    }

    #[test]
    fn a_binary_without_an_interpreter_is_static() {
        // A minimal ELF64 header with one PT_LOAD program header and no PT_INTERP.
        let mut elf = vec![0u8; 64 + 56];
        elf[..4].copy_from_slice(b"\x7fELF");
        elf[4] = 2;
        elf[5] = 1;
        elf[0x20..0x28].copy_from_slice(&64u64.to_le_bytes());
        elf[0x36..0x38].copy_from_slice(&56u16.to_le_bytes());
        elf[0x38..0x3a].copy_from_slice(&1u16.to_le_bytes());
        elf[64..68].copy_from_slice(&1u32.to_le_bytes());
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("static");
        std::fs::write(&path, &elf).unwrap();
        assert!(is_static(&path).unwrap());
        elf[64..68].copy_from_slice(&3u32.to_le_bytes());
        std::fs::write(&path, &elf).unwrap();
        assert!(!is_static(&path).unwrap());
    }
}
