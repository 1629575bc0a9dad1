//! A 64-bit FNV-1a digest of everything written to it, for guard tests that
//! pin a model's answers to a recorded value.

/// FNV-1a over the bytes of everything written to it (`write!` into it).
#[derive(Clone, Debug)]
pub struct Digest(u64);

impl Digest {
    /// A digest of nothing yet.
    pub fn new() -> Self {
        Self(0xcbf2_9ce4_8422_2325)
    }

    /// The digest so far.
    pub fn value(&self) -> u64 {
        self.0
    }
}

impl Default for Digest {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Write for Digest {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        for b in s.bytes() {
            self.0 ^= u64::from(b);
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fmt::Write as _;

    #[test]
    fn it_is_fnv_1a() {
        // The published FNV-1a 64 test vectors.
        assert_eq!(Digest::new().value(), 0xcbf2_9ce4_8422_2325);
        let mut d = Digest::new();
        write!(d, "a").unwrap();
        assert_eq!(d.value(), 0xaf63_dc4c_8601_ec8c);
        let mut d = Digest::new();
        write!(d, "foobar").unwrap();
        assert_eq!(d.value(), 0x8594_4171_f739_67e8);
    }
}
