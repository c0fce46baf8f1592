//! Bounded decoding of an encoded state: read a value field by field out of the bytes of one
//! frame, without allocating more than those bytes and the device's own limits allow.
//!
//! A migration stream is client data. [`decode_state`](super::decode_state) decodes a whole
//! serde value at once, which is right for small fixed-size states but not for a state that
//! carries sequences: serde's `Vec` decoding pre-allocates at most 1 MiB whatever length the
//! stream declares (`serde::__private::size_hint::cautious`), then grows by doubling as
//! elements arrive, so memory is bounded by the input, but the sequence is held whole (in
//! memory a `Vec<[u32; 3]>` is up to 4 times its varint encoding, a `Vec` of small enums
//! 10 times) before any of it can be checked. A [`Decoder`] instead lets a device
//!
//! - borrow byte strings out of the frame ([`Decoder::bytes`]: no copy; postcard encodes a
//!   `Vec<u8>` and a byte string the same way, a length and the bytes),
//! - read a sequence's declared length itself and check it against what this device can
//!   hold and against what the remaining bytes can encode ([`Decoder::seq_len`]) before
//!   anything is allocated for it,
//! - then take the elements one at a time ([`Decoder::value`]), checking or applying each.
//!
//! The wire format is postcard's, so a state written with `encode_state` of a serde struct
//! reads back field by field: postcard writes a struct's fields one after another with no
//! framing of their own.

use serde::Deserialize;

use super::{decode_header, MigrationError};

/// Reads the fields of one encoded state in order (see the module doc).
#[derive(Debug, Clone)]
pub struct Decoder<'a> {
    format: &'a str,
    rest: &'a [u8],
}

impl<'a> Decoder<'a> {
    /// Check the header of `bytes` (format `format`, a version in `min..=max`, as
    /// [`decode_header`]) and return its version and a decoder of the value behind it.
    pub fn new(
        format: &'a str,
        min: u32,
        max: u32,
        bytes: &'a [u8],
    ) -> Result<(u32, Decoder<'a>), MigrationError> {
        let (version, rest) = decode_header(format, min, max, bytes)?;
        Ok((version, Decoder { format, rest }))
    }

    /// A decoder of `bytes` with no header in front (a section inside a value).
    pub fn raw(format: &'a str, bytes: &'a [u8]) -> Decoder<'a> {
        Decoder {
            format,
            rest: bytes,
        }
    }

    /// Bytes not decoded yet.
    pub fn remaining(&self) -> usize {
        self.rest.len()
    }

    /// A [`MigrationError::Malformed`] of this decoder's format.
    pub fn malformed(&self, why: impl Into<String>) -> MigrationError {
        MigrationError::Malformed {
            format: self.format.to_owned(),
            why: why.into(),
        }
    }

    /// The next value. Use it for values of bounded size (numbers, small structs, borrowed
    /// byte strings); a sequence goes through [`Decoder::seq_len`] and its elements.
    pub fn value<T: Deserialize<'a>>(&mut self) -> Result<T, MigrationError> {
        let (v, rest) =
            postcard::take_from_bytes::<T>(self.rest).map_err(|e| self.malformed(e.to_string()))?;
        self.rest = rest;
        Ok(v)
    }

    /// The next byte string (a serde `Vec<u8>` or byte string), borrowed from the input.
    pub fn bytes(&mut self) -> Result<&'a [u8], MigrationError> {
        self.value::<&'a [u8]>()
    }

    /// The declared length of the next sequence, refused if it is over `max` (what this
    /// device can hold) or if the remaining bytes cannot hold that many elements of at
    /// least `min_wire` bytes each (a length that lies). The elements follow.
    pub fn seq_len(&mut self, max: usize, min_wire: usize) -> Result<usize, MigrationError> {
        let declared: u64 = self.value()?;
        let fits = (self.rest.len() / min_wire.max(1)) as u64;
        if declared > max as u64 {
            return Err(self.malformed(format!(
                "a sequence of {declared} elements, this device holds at most {max}"
            )));
        }
        if declared > fits {
            return Err(self.malformed(format!(
                "a sequence of {declared} elements in {} bytes",
                self.rest.len()
            )));
        }
        Ok(declared as usize)
    }

    /// The bytes not decoded yet, borrowed from the input (a section that follows this
    /// value and is decoded by someone else, such as a device's section behind its
    /// transport's).
    pub fn into_rest(self) -> &'a [u8] {
        self.rest
    }

    /// The whole value was read: refuse trailing bytes.
    pub fn finish(self) -> Result<(), MigrationError> {
        if self.rest.is_empty() {
            Ok(())
        } else {
            Err(self.malformed(format!("{} trailing bytes", self.rest.len())))
        }
    }
}

#[cfg(test)]
mod tests {
    use serde::Serialize;

    use super::*;
    use crate::migration::encode_state;

    #[derive(Serialize)]
    struct Sample {
        id: u32,
        blob: Vec<u8>,
        words: Vec<u32>,
    }

    #[test]
    fn test_decoder_reads_fields_of_a_serde_struct_in_order() {
        let s = Sample {
            id: 7,
            blob: vec![1, 2, 3],
            words: vec![5, 0xffff_ffff],
        };
        let bytes = encode_state("f", 2, &s).unwrap();
        let (version, mut d) = Decoder::new("f", 1, 2, &bytes).unwrap();
        assert_eq!(version, 2);
        assert_eq!(d.value::<u32>().unwrap(), 7);
        assert_eq!(d.bytes().unwrap(), &[1, 2, 3]);
        let n = d.seq_len(2, 1).unwrap();
        let words: Vec<u32> = (0..n).map(|_| d.value().unwrap()).collect();
        assert_eq!(words, [5, 0xffff_ffff]);
        d.finish().unwrap();
    }

    #[test]
    fn test_decoder_seq_len_over_device_limit_or_input_refused() {
        let s = Sample {
            id: 1,
            blob: vec![],
            words: vec![1; 10],
        };
        let bytes = encode_state("f", 1, &s).unwrap();
        let (_, d) = Decoder::new("f", 1, 1, &bytes).unwrap();
        let mut over_limit = d.clone();
        over_limit.value::<u32>().unwrap();
        over_limit.bytes().unwrap();
        assert!(over_limit.seq_len(9, 1).is_err(), "10 elements, limit 9");
        let mut lying = d.clone();
        lying.value::<u32>().unwrap();
        lying.bytes().unwrap();
        assert!(
            lying.seq_len(100, 2).is_err(),
            "10 one-byte elements cannot be 2-byte ones"
        );
        // A length of 2^60 in a few bytes: refused before anything is allocated.
        let mut huge = Vec::new();
        huge.extend(postcard::to_allocvec(&(1u64 << 60)).unwrap());
        let mut d = Decoder::raw("f", &huge);
        assert!(d.seq_len(usize::MAX, 1).is_err());
        // A byte string longer than the input.
        let mut d = Decoder::raw("f", &[0x80, 0x80, 0x04, 1, 2]);
        assert!(d.bytes().is_err());
        let mut d = Decoder::raw("f", &[1, 2, 3]);
        d.value::<u8>().unwrap();
        assert!(d.finish().is_err(), "trailing bytes");
    }
}
