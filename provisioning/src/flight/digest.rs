//! The digest of a host's answer: a serde `Serializer` that folds every
//! value it is shown into one 64-bit hash, word by word, without building
//! an encoding first.
//!
//! Integers go in as 64-bit words, strings and bytes as their length and
//! then eight bytes at a time, every variant as its index, every sequence
//! and map as its length: two answers that encode differently (in any
//! self-delimiting encoding) digest differently unless the hash collides.
//! A string written in pieces (`collect_str`) digests as the same string
//! written at once. The hash mixes each word FxHash-style into one of two
//! lanes in turn and ends by mixing the lanes and a 64-bit finaliser; it
//! is fixed here, so a recording's digests mean the same to every build
//! that reads its format.

use serde::ser::{self, Serialize};
use std::fmt;

const K: u64 = 0x517c_c1b7_2722_0a95;

/// Folded in after a sequence's last element.
pub(super) const SEQ_END: u64 = 0x5e9_e4d;

/// The running hash, with up to seven bytes of a string not yet folded in.
///
/// Words go into two lanes in turn, so that each multiplication waits for
/// the one two words back rather than the last: a pass over 100,000 nodes
/// folds millions of words, and one chain of multiplications was what its
/// digest waited on.
#[derive(Clone, Copy)]
pub(super) struct Hasher {
    /// The lane the next word goes into.
    a: u64,
    b: u64,
    tail: u64,
    tail_len: u32,
}

impl Hasher {
    pub(super) fn new() -> Self {
        Self {
            a: 0x243f_6a88_85a3_08d3,
            b: 0x1319_8a2e_0370_7344,
            tail: 0,
            tail_len: 0,
        }
    }

    #[inline]
    pub(super) fn word(&mut self, w: u64) {
        let folded = (self.a.rotate_left(5) ^ w).wrapping_mul(K);
        self.a = self.b;
        self.b = folded;
    }

    /// Bytes of a string or a byte array, any number of pieces at a time.
    #[inline]
    fn bytes(&mut self, mut b: &[u8]) {
        if self.tail_len > 0 {
            while self.tail_len < 8 {
                let Some((&first, rest)) = b.split_first() else {
                    return;
                };
                self.tail |= u64::from(first) << (8 * self.tail_len);
                self.tail_len += 1;
                b = rest;
            }
            let t = self.tail;
            self.word(t);
            self.tail = 0;
            self.tail_len = 0;
        }
        let mut chunks = b.chunks_exact(8);
        for c in &mut chunks {
            let mut w = [0u8; 8];
            w.copy_from_slice(c);
            self.word(u64::from_le_bytes(w));
        }
        for (i, &byte) in chunks.remainder().iter().enumerate() {
            self.tail |= u64::from(byte) << (8 * i);
        }
        self.tail_len = chunks.remainder().len() as u32;
    }

    /// Folds in a string as serde shows it.
    #[inline]
    pub(super) fn str(&mut self, s: &str) {
        self.bytes(s.as_bytes());
        self.end_bytes(s.len() as u64);
    }

    /// Ends a string of `len` bytes.
    #[inline]
    fn end_bytes(&mut self, len: u64) {
        if self.tail_len > 0 {
            let t = self.tail;
            self.word(t);
            self.tail = 0;
            self.tail_len = 0;
        }
        self.word(len);
    }

    pub(super) fn finish(mut self) -> u64 {
        self.end_bytes(0);
        // Both lanes, in order (the one written last comes last).
        let mut x = (self.a.rotate_left(5) ^ self.b).wrapping_mul(K);
        x ^= x >> 33;
        x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
        x ^= x >> 33;
        x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
        x ^ (x >> 33)
    }
}

impl Hasher {
    /// Folds in `value` as [`of`] would.
    ///
    /// Through a copy: serde takes the hasher by reference, and a hasher
    /// whose address a call was given lives in memory from then on, every
    /// word stored and loaded again. The copy keeps the caller's in
    /// registers, across a pass's 200,000 dispatches.
    #[inline]
    pub(super) fn value<T: Serialize + ?Sized>(&mut self, value: &T) {
        let mut h = *self;
        let _ = value.serialize(&mut h);
        *self = h;
    }
}

/// The digest of `value`.
pub(super) fn of<T: Serialize + ?Sized>(value: &T) -> u64 {
    let mut h = Hasher::new();
    // Hashing cannot fail; a value serde refuses to show gets the digest of
    // what it showed before it refused.
    let _ = value.serialize(&mut h);
    h.finish()
}

/// Never raised: digesting cannot fail.
#[derive(Debug)]
pub(super) struct Never;

impl fmt::Display for Never {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("digest error")
    }
}

impl std::error::Error for Never {}

impl ser::Error for Never {
    fn custom<T: fmt::Display>(_: T) -> Self {
        Self
    }
}

/// Counts a `collect_str`'s bytes while hashing them.
struct Pieces<'a> {
    h: &'a mut Hasher,
    len: u64,
}

impl fmt::Write for Pieces<'_> {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        self.h.bytes(s.as_bytes());
        self.len += s.len() as u64;
        Ok(())
    }
}

type R = Result<(), Never>;

impl ser::Serializer for &mut Hasher {
    type Ok = ();
    type Error = Never;
    type SerializeSeq = Self;
    type SerializeTuple = Self;
    type SerializeTupleStruct = Self;
    type SerializeTupleVariant = Self;
    type SerializeMap = Self;
    type SerializeStruct = Self;
    type SerializeStructVariant = Self;

    fn serialize_bool(self, v: bool) -> R {
        self.word(u64::from(v));
        Ok(())
    }
    fn serialize_i8(self, v: i8) -> R {
        self.serialize_i64(i64::from(v))
    }
    fn serialize_i16(self, v: i16) -> R {
        self.serialize_i64(i64::from(v))
    }
    fn serialize_i32(self, v: i32) -> R {
        self.serialize_i64(i64::from(v))
    }
    fn serialize_i64(self, v: i64) -> R {
        self.word(v as u64);
        Ok(())
    }
    fn serialize_i128(self, v: i128) -> R {
        self.word(v as u64);
        self.word((v >> 64) as u64);
        Ok(())
    }
    fn serialize_u8(self, v: u8) -> R {
        self.serialize_u64(u64::from(v))
    }
    fn serialize_u16(self, v: u16) -> R {
        self.serialize_u64(u64::from(v))
    }
    fn serialize_u32(self, v: u32) -> R {
        self.serialize_u64(u64::from(v))
    }
    fn serialize_u64(self, v: u64) -> R {
        self.word(v);
        Ok(())
    }
    fn serialize_u128(self, v: u128) -> R {
        self.word(v as u64);
        self.word((v >> 64) as u64);
        Ok(())
    }
    fn serialize_f32(self, v: f32) -> R {
        self.serialize_f64(f64::from(v))
    }
    fn serialize_f64(self, v: f64) -> R {
        self.word(v.to_bits());
        Ok(())
    }
    fn serialize_char(self, v: char) -> R {
        self.word(u64::from(v));
        Ok(())
    }
    fn serialize_str(self, v: &str) -> R {
        self.str(v);
        Ok(())
    }
    fn serialize_bytes(self, v: &[u8]) -> R {
        self.bytes(v);
        self.end_bytes(v.len() as u64);
        Ok(())
    }
    fn serialize_none(self) -> R {
        self.word(0);
        Ok(())
    }
    fn serialize_some<T: Serialize + ?Sized>(self, value: &T) -> R {
        self.word(1);
        value.serialize(self)
    }
    fn serialize_unit(self) -> R {
        Ok(())
    }
    fn serialize_unit_struct(self, _: &'static str) -> R {
        Ok(())
    }
    fn serialize_unit_variant(self, _: &'static str, index: u32, _: &'static str) -> R {
        self.word(u64::from(index));
        Ok(())
    }
    fn serialize_newtype_struct<T: Serialize + ?Sized>(self, _: &'static str, value: &T) -> R {
        value.serialize(self)
    }
    fn serialize_newtype_variant<T: Serialize + ?Sized>(
        self,
        _: &'static str,
        index: u32,
        _: &'static str,
        value: &T,
    ) -> R {
        self.word(u64::from(index));
        value.serialize(self)
    }
    fn serialize_seq(self, len: Option<usize>) -> Result<Self, Never> {
        // An unknown length is marked apart from every known one; its end
        // is marked too, so what follows cannot run into it.
        self.word(len.map_or(u64::MAX, |n| n as u64));
        Ok(self)
    }
    fn serialize_tuple(self, _: usize) -> Result<Self, Never> {
        Ok(self)
    }
    fn serialize_tuple_struct(self, _: &'static str, _: usize) -> Result<Self, Never> {
        Ok(self)
    }
    fn serialize_tuple_variant(
        self,
        _: &'static str,
        index: u32,
        _: &'static str,
        _: usize,
    ) -> Result<Self, Never> {
        self.word(u64::from(index));
        Ok(self)
    }
    fn serialize_map(self, len: Option<usize>) -> Result<Self, Never> {
        self.word(len.map_or(u64::MAX, |n| n as u64));
        Ok(self)
    }
    fn serialize_struct(self, _: &'static str, _: usize) -> Result<Self, Never> {
        Ok(self)
    }
    fn serialize_struct_variant(
        self,
        _: &'static str,
        index: u32,
        _: &'static str,
        _: usize,
    ) -> Result<Self, Never> {
        self.word(u64::from(index));
        Ok(self)
    }
    fn collect_str<T: fmt::Display + ?Sized>(self, value: &T) -> R {
        use fmt::Write;
        let mut pieces = Pieces { h: self, len: 0 };
        let _ = write!(pieces, "{value}");
        let len = pieces.len;
        self.end_bytes(len);
        Ok(())
    }
    fn is_human_readable(&self) -> bool {
        false
    }
}

macro_rules! compound {
    ($trait:ident, $method:ident $(, $key:ident)?) => {
        impl ser::$trait for &mut Hasher {
            type Ok = ();
            type Error = Never;
            fn $method<T: Serialize + ?Sized>(&mut self, $($key: &'static str,)? value: &T) -> R {
                $(let _ = $key;)?
                value.serialize(&mut **self)
            }
            fn end(self) -> R {
                Ok(())
            }
        }
    };
}

compound!(SerializeTuple, serialize_element);
compound!(SerializeTupleStruct, serialize_field);
compound!(SerializeTupleVariant, serialize_field);
compound!(SerializeStruct, serialize_field, key);
compound!(SerializeStructVariant, serialize_field, key);

impl ser::SerializeSeq for &mut Hasher {
    type Ok = ();
    type Error = Never;
    fn serialize_element<T: Serialize + ?Sized>(&mut self, value: &T) -> R {
        value.serialize(&mut **self)
    }
    fn end(self) -> R {
        self.word(SEQ_END);
        Ok(())
    }
}

impl ser::SerializeMap for &mut Hasher {
    type Ok = ();
    type Error = Never;
    fn serialize_key<T: Serialize + ?Sized>(&mut self, key: &T) -> R {
        key.serialize(&mut **self)
    }
    fn serialize_value<T: Serialize + ?Sized>(&mut self, value: &T) -> R {
        value.serialize(&mut **self)
    }
    fn end(self) -> R {
        self.word(0x3a9_e4d);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(serde::Serialize)]
    enum E {
        A(String),
        B { s: String, n: u32 },
    }

    struct Pieced(&'static [&'static str]);
    impl fmt::Display for Pieced {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            self.0.iter().try_for_each(|p| f.write_str(p))
        }
    }
    impl Serialize for Pieced {
        fn serialize<S: ser::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            s.collect_str(self)
        }
    }

    #[test]
    fn a_string_in_pieces_digests_as_the_whole() {
        let whole = of("worker-12345678");
        assert_eq!(of(&Pieced(&["worker", "-", "1234", "5678"])), whole);
        assert_eq!(of(&Pieced(&["w", "orker-12345678"])), whole);
        assert_ne!(of("worker-12345679"), whole);
    }

    #[test]
    fn where_one_value_ends_and_the_next_begins_counts() {
        assert_ne!(of(&("ab", "c")), of(&("a", "bc")));
        assert_ne!(
            of(&(vec![1u8, 2], vec![3u8])),
            of(&(vec![1u8], vec![2u8, 3]))
        );
        assert_ne!(
            of(&E::A("x".into())),
            of(&E::B {
                s: "x".into(),
                n: 0
            })
        );
        assert_ne!(of(&Some(0u32)), of(&None::<u32>));
        assert_ne!(of(&(Some(()), 0u8)), of(&(None::<()>, 1u8)));
        assert_eq!(
            of(&E::B {
                s: "x".into(),
                n: 7
            }),
            of(&E::B {
                s: "x".into(),
                n: 7
            })
        );
    }
}
