//! A minimal in-memory tar (ustar) writer: the engine takes build contexts and
//! file uploads as tar archives, and ours hold at most three small entries.

/// Bytes per tar block.
const BLOCK_LEN: usize = 512;
/// Longest entry name the plain ustar header holds.
pub(crate) const NAME_LEN_MAX: usize = 99;

/// An archive being written.
#[derive(Default)]
pub(crate) struct TarWriter {
    out: Vec<u8>,
}

impl TarWriter {
    /// A writer whose buffer can take `capacity` bytes of content without growing.
    pub(crate) fn with_capacity(capacity: usize) -> Self {
        Self {
            out: Vec::with_capacity(capacity + 4 * BLOCK_LEN),
        }
    }

    /// Adds a directory entry (`name` without a trailing slash).
    pub(crate) fn dir(&mut self, name: &str, mode: u32) {
        self.header(&format!("{name}/"), mode, 0, b'5');
    }

    /// Adds a regular file.
    pub(crate) fn file(&mut self, name: &str, mode: u32, content: &[u8]) {
        self.header(name, mode, content.len() as u64, b'0');
        self.out.extend_from_slice(content);
        let pad = (BLOCK_LEN - content.len() % BLOCK_LEN) % BLOCK_LEN;
        self.out.resize(self.out.len() + pad, 0);
    }

    /// The archive, closed with its two zero blocks.
    pub(crate) fn finish(mut self) -> Vec<u8> {
        self.out.resize(self.out.len() + 2 * BLOCK_LEN, 0);
        self.out
    }

    fn header(&mut self, name: &str, mode: u32, size: u64, kind: u8) {
        // Names are this module's own constants: a longer one is a bug.
        assert!(
            name.len() <= NAME_LEN_MAX && name.is_ascii(),
            "tar entry name {name:?}"
        );
        let mut h = [0u8; BLOCK_LEN];
        h[..name.len()].copy_from_slice(name.as_bytes());
        octal(&mut h[100..108], u64::from(mode));
        octal(&mut h[108..116], 0); // uid: root
        octal(&mut h[116..124], 0); // gid: root
        octal(&mut h[124..136], size);
        octal(&mut h[136..148], 0); // mtime
        h[156] = kind;
        h[257..263].copy_from_slice(b"ustar\0");
        h[263..265].copy_from_slice(b"00");
        // The checksum is computed with its own field as spaces.
        h[148..156].copy_from_slice(b"        ");
        let sum: u32 = h.iter().map(|b| u32::from(*b)).sum();
        octal(&mut h[148..155], u64::from(sum));
        h[155] = b' ';
        self.out.extend_from_slice(&h);
    }
}

/// Writes `value` in octal, zero-padded, NUL-terminated, filling `field`.
fn octal(field: &mut [u8], value: u64) {
    let digits = field.len() - 1;
    let text = format!("{value:0digits$o}");
    assert!(text.len() == digits, "{value} does not fit a tar field");
    field[..digits].copy_from_slice(text.as_bytes());
    field[digits] = 0;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_are_block_aligned_and_checksummed() {
        let mut tar = TarWriter::default();
        tar.dir("swactor", 0o700);
        tar.file("swactor/a", 0o600, b"hello");
        let out = tar.finish();
        assert_eq!(out.len(), 5 * BLOCK_LEN);
        let file = &out[BLOCK_LEN..2 * BLOCK_LEN];
        assert_eq!(&file[..9], b"swactor/a");
        assert_eq!(&file[100..108], b"0000600\0");
        assert_eq!(&file[124..136], b"00000000005\0");
        let mut blank = file.to_vec();
        blank[148..156].copy_from_slice(b"        ");
        let sum: u32 = blank.iter().map(|b| u32::from(*b)).sum();
        let stored = std::str::from_utf8(&file[148..154]).unwrap();
        assert_eq!(u32::from_str_radix(stored, 8).unwrap(), sum);
        assert_eq!(&out[2 * BLOCK_LEN..2 * BLOCK_LEN + 5], b"hello");
        assert!(out[3 * BLOCK_LEN..].iter().all(|b| *b == 0));
    }
}
