//! Byte cursors for the wire format: native-endian integers (the spec says "host endianness"),
//! every read bounds-checked.

use super::ProtocolError;

/// Reads integers and byte runs from a message payload; every read is checked.
#[derive(Debug, Clone)]
pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    what: &'static str,
}

impl<'a> Reader<'a> {
    /// A reader over `buf`; `what` names the structure in error messages.
    pub fn new(buf: &'a [u8], what: &'static str) -> Self {
        Reader { buf, pos: 0, what }
    }

    /// Bytes not read yet.
    pub fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    /// The next `n` bytes.
    pub fn bytes(&mut self, n: usize) -> Result<&'a [u8], ProtocolError> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.buf.len())
            .ok_or(ProtocolError::Truncated {
                what: self.what,
                need: self.pos.saturating_add(n),
                got: self.buf.len(),
            })?;
        let out = &self.buf[self.pos..end];
        self.pos = end;
        Ok(out)
    }

    /// The rest of the buffer.
    pub fn rest(&mut self) -> &'a [u8] {
        let out = &self.buf[self.pos..];
        self.pos = self.buf.len();
        out
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], ProtocolError> {
        let b = self.bytes(N)?;
        let mut a = [0u8; N];
        a.copy_from_slice(b);
        Ok(a)
    }

    /// A u16.
    pub fn u16(&mut self) -> Result<u16, ProtocolError> {
        Ok(u16::from_ne_bytes(self.array()?))
    }

    /// A u32.
    pub fn u32(&mut self) -> Result<u32, ProtocolError> {
        Ok(u32::from_ne_bytes(self.array()?))
    }

    /// A u64.
    pub fn u64(&mut self) -> Result<u64, ProtocolError> {
        Ok(u64::from_ne_bytes(self.array()?))
    }
}

/// Appends native-endian integers to a message buffer.
pub trait Put {
    /// Append a u16.
    fn put_u16(&mut self, v: u16);
    /// Append a u32.
    fn put_u32(&mut self, v: u32);
    /// Append a u64.
    fn put_u64(&mut self, v: u64);
}

impl Put for Vec<u8> {
    fn put_u16(&mut self, v: u16) {
        self.extend_from_slice(&v.to_ne_bytes());
    }
    fn put_u32(&mut self, v: u32) {
        self.extend_from_slice(&v.to_ne_bytes());
    }
    fn put_u64(&mut self, v: u64) {
        self.extend_from_slice(&v.to_ne_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_reader_short_buffer_returns_truncated() {
        let mut r = Reader::new(&[1, 2, 3], "x");
        assert_eq!(r.u16().unwrap(), u16::from_ne_bytes([1, 2]));
        assert!(matches!(r.u32(), Err(ProtocolError::Truncated { .. })));
        assert_eq!(r.remaining(), 1);
    }

    #[test]
    fn test_put_roundtrip_integers_match() {
        let mut v = Vec::new();
        v.put_u16(7);
        v.put_u32(0xdead_beef);
        v.put_u64(u64::MAX - 1);
        let mut r = Reader::new(&v, "x");
        assert_eq!(r.u16().unwrap(), 7);
        assert_eq!(r.u32().unwrap(), 0xdead_beef);
        assert_eq!(r.u64().unwrap(), u64::MAX - 1);
        assert_eq!(r.remaining(), 0);
    }
}
