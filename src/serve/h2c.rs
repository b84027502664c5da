//! The smallest HTTP/2 client a unary gRPC call needs (issue 49: the guest binary back under
//! 12 MiB without hyper's HTTP/2 client and the h2 crate). One stream, over a
//! connection nothing else uses, cleartext ("prior knowledge", RFC 9113 §3.3), as virt-handler's
//! CA server speaks it:
//!
//! 1. The client sends the preface, its SETTINGS (no push; a stream window and a connection
//!    window larger than the largest answer taken, so it never has to send WINDOW_UPDATE), the
//!    request's HEADERS and its one DATA frame with END_STREAM (RFC 9113 §3.4, §6.5, §6.9).
//! 2. It answers the server's SETTINGS with an ACK and a PING with a PING ACK (§6.5.3, §6.7),
//!    ignores WINDOW_UPDATE and PRIORITY, and fails on RST_STREAM, GOAWAY, a frame larger than
//!    the default 16,384 bytes (§4.2) or an answer past `max`.
//! 3. Every header block is decoded (HPACK, RFC 7541: the static table, the dynamic table and its
//!    size updates, Huffman strings) — the dynamic table is the connection's state, so a block
//!    skipped would garble the next. The answer is the first block (`:status`, and
//!    `grpc-status` for a trailers-only answer), the DATA, and the trailers.
//! 4. Request headers are sent as literals without indexing and without Huffman (RFC 7541 §6.2.2):
//!    any encoder state is then the server's alone to keep.
//!
//! Pure over any byte stream: the tests drive it against Python's grpcio (tests/fixtures/kubevirt).

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const DATA: u8 = 0x0;
const HEADERS: u8 = 0x1;
const RST_STREAM: u8 = 0x3;
const SETTINGS: u8 = 0x4;
const PING: u8 = 0x6;
const GOAWAY: u8 = 0x7;
const CONTINUATION: u8 = 0x9;
const END_STREAM: u8 = 0x1;
const ACK: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;
/// SETTINGS_MAX_FRAME_SIZE's initial value, which this client never raises (RFC 9113 §6.5.2).
const MAX_FRAME: usize = 16_384;
/// SETTINGS_HEADER_TABLE_SIZE's initial value (RFC 9113 §6.5.2), which this client keeps.
const TABLE_SIZE: usize = 4096;

/// An answer: the first header block, the DATA frames' bytes, the trailers (empty when the
/// answer was trailers-only or had none).
#[derive(Debug, Default)]
pub struct Answer {
    pub headers: Vec<(String, String)>,
    pub data: Vec<u8>,
    pub trailers: Vec<(String, String)>,
}

impl Answer {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
    }
    pub fn trailer(&self, name: &str) -> Option<&str> {
        self.trailers.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
    }
}

/// `POST path` with `body` on stream 1 of a fresh connection; at most `max` bytes of answer.
pub async fn post<S>(
    mut io: S,
    authority: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
    max: usize,
) -> Result<Answer, String>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let window = (max + MAX_FRAME) as u32;
    let mut out = PREFACE.to_vec();
    // SETTINGS: ENABLE_PUSH (0x2) = 0, INITIAL_WINDOW_SIZE (0x4) = window.
    let mut settings = Vec::new();
    settings.extend_from_slice(&[0, 2, 0, 0, 0, 0]);
    settings.extend_from_slice(&[0, 4]);
    settings.extend_from_slice(&window.to_be_bytes());
    frame(&mut out, SETTINGS, 0, 0, &settings);
    // The connection's window starts at 65,535 whatever SETTINGS say (§6.9.2): raise it.
    frame(&mut out, 0x8, 0, 0, &(window.saturating_sub(65_535)).to_be_bytes());
    let mut block = Vec::new();
    block.push(0x83); // :method POST, static index 3
    block.push(0x86); // :scheme http, static index 6
    literal(&mut block, 4, path); // :path
    literal(&mut block, 1, authority); // :authority
    for (k, v) in headers {
        block.push(0x00);
        string(&mut block, k);
        string(&mut block, v);
    }
    if block.len() > MAX_FRAME {
        return Err("the request's headers are larger than one frame".into());
    }
    frame(&mut out, HEADERS, END_HEADERS, 1, &block);
    for (i, chunk) in body.chunks(MAX_FRAME).enumerate() {
        let last = (i + 1) * MAX_FRAME >= body.len();
        frame(&mut out, DATA, if last { END_STREAM } else { 0 }, 1, chunk);
    }
    if body.is_empty() {
        frame(&mut out, DATA, END_STREAM, 1, &[]);
    }
    io.write_all(&out).await.map_err(|e| format!("HTTP/2: {e}"))?;
    io.flush().await.map_err(|e| format!("HTTP/2: {e}"))?;

    let mut hpack = Decoder::new();
    let mut answer = Answer::default();
    let mut blocks = 0;
    let mut pending: Option<(Vec<u8>, bool)> = None;
    loop {
        let mut head = [0u8; 9];
        io.read_exact(&mut head)
            .await
            .map_err(|e| format!("HTTP/2: the connection ended before the answer did: {e}"))?;
        let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
        let (kind, flags) = (head[3], head[4]);
        let stream = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
        if len > MAX_FRAME {
            return Err(format!("HTTP/2: a frame of {len} bytes, over the {MAX_FRAME} this client allows"));
        }
        let mut payload = vec![0u8; len];
        io.read_exact(&mut payload).await.map_err(|e| format!("HTTP/2: {e}"))?;
        if pending.is_some() && kind != CONTINUATION {
            return Err("HTTP/2: a header block not followed by its CONTINUATION".into());
        }
        match kind {
            SETTINGS if flags & ACK == 0 => {
                let mut ack = Vec::new();
                frame(&mut ack, SETTINGS, ACK, 0, &[]);
                io.write_all(&ack).await.map_err(|e| format!("HTTP/2: {e}"))?;
            }
            PING if flags & ACK == 0 && len == 8 => {
                let mut pong = Vec::new();
                frame(&mut pong, PING, ACK, 0, &payload);
                io.write_all(&pong).await.map_err(|e| format!("HTTP/2: {e}"))?;
            }
            GOAWAY => {
                let code = payload.get(4..8).map(|c| u32::from_be_bytes([c[0], c[1], c[2], c[3]])).unwrap_or(0);
                return Err(format!("HTTP/2: the server went away (error code {code})"));
            }
            RST_STREAM if stream == 1 => {
                let code = payload.get(..4).map(|c| u32::from_be_bytes([c[0], c[1], c[2], c[3]])).unwrap_or(0);
                return Err(format!("HTTP/2: the server reset the stream (error code {code})"));
            }
            DATA if stream == 1 => {
                let data = unpad(&payload, flags)?;
                if answer.data.len() + data.len() > max {
                    return Err(format!("the answer is larger than {max} bytes"));
                }
                answer.data.extend_from_slice(data);
                if flags & END_STREAM != 0 {
                    return Ok(answer);
                }
            }
            HEADERS => {
                let mut frag = unpad(&payload, flags)?;
                if flags & PRIORITY != 0 {
                    frag = frag.get(5..).ok_or("HTTP/2: a HEADERS frame too short for its priority")?;
                }
                pending = Some((frag.to_vec(), flags & END_STREAM != 0 && stream == 1));
                if flags & END_HEADERS == 0 {
                    continue;
                }
            }
            CONTINUATION => match pending.as_mut() {
                Some((b, _)) => {
                    b.extend_from_slice(&payload);
                    if b.len() > 64 << 10 {
                        return Err("HTTP/2: a header block over 64 KiB".into());
                    }
                    if flags & END_HEADERS == 0 {
                        continue;
                    }
                }
                None => return Err("HTTP/2: a CONTINUATION without its HEADERS".into()),
            },
            _ => {}
        }
        if let Some((block, ends)) = pending.take() {
            let fields = hpack.decode(&block)?;
            if stream == 1 {
                if blocks == 0 {
                    answer.headers = fields;
                } else {
                    answer.trailers = fields;
                }
                blocks += 1;
                if ends {
                    return Ok(answer);
                }
            }
        }
    }
}

fn frame(out: &mut Vec<u8>, kind: u8, flags: u8, stream: u32, payload: &[u8]) {
    let len = payload.len() as u32;
    out.extend_from_slice(&len.to_be_bytes()[1..]);
    out.push(kind);
    out.push(flags);
    out.extend_from_slice(&stream.to_be_bytes());
    out.extend_from_slice(payload);
}

/// A DATA or HEADERS payload without its padding (RFC 9113 §6.1, §6.2).
fn unpad(p: &[u8], flags: u8) -> Result<&[u8], String> {
    if flags & PADDED == 0 {
        return Ok(p);
    }
    let pad = *p.first().ok_or("HTTP/2: a padded frame with no pad length")? as usize;
    p.get(1..p.len().checked_sub(pad).ok_or("HTTP/2: more padding than frame")?)
        .ok_or_else(|| "HTTP/2: more padding than frame".into())
}

/// A literal header field without indexing, its name a static-table index (RFC 7541 §6.2.2).
fn literal(out: &mut Vec<u8>, name_index: u8, value: &str) {
    out.push(name_index); // 0000xxxx: the index fits 4 bits for :authority (1) and :path (4)
    string(out, value);
}

/// A string literal, not Huffman-coded (RFC 7541 §5.2).
fn string(out: &mut Vec<u8>, s: &str) {
    integer(out, 0x00, 7, s.len());
    out.extend_from_slice(s.as_bytes());
}

/// An integer with an N-bit prefix (RFC 7541 §5.1).
fn integer(out: &mut Vec<u8>, first: u8, n: u32, mut v: usize) {
    let max = (1usize << n) - 1;
    if v < max {
        out.push(first | v as u8);
        return;
    }
    out.push(first | max as u8);
    v -= max;
    while v >= 128 {
        out.push((v % 128) as u8 | 0x80);
        v /= 128;
    }
    out.push(v as u8);
}

/// RFC 7541 Appendix A.
const STATIC: [(&str, &str); 61] = [
    (":authority", ""),
    (":method", "GET"),
    (":method", "POST"),
    (":path", "/"),
    (":path", "/index.html"),
    (":scheme", "http"),
    (":scheme", "https"),
    (":status", "200"),
    (":status", "204"),
    (":status", "206"),
    (":status", "304"),
    (":status", "400"),
    (":status", "404"),
    (":status", "500"),
    ("accept-charset", ""),
    ("accept-encoding", "gzip, deflate"),
    ("accept-language", ""),
    ("accept-ranges", ""),
    ("accept", ""),
    ("access-control-allow-origin", ""),
    ("age", ""),
    ("allow", ""),
    ("authorization", ""),
    ("cache-control", ""),
    ("content-disposition", ""),
    ("content-encoding", ""),
    ("content-language", ""),
    ("content-length", ""),
    ("content-location", ""),
    ("content-range", ""),
    ("content-type", ""),
    ("cookie", ""),
    ("date", ""),
    ("etag", ""),
    ("expect", ""),
    ("expires", ""),
    ("from", ""),
    ("host", ""),
    ("if-match", ""),
    ("if-modified-since", ""),
    ("if-none-match", ""),
    ("if-range", ""),
    ("if-unmodified-since", ""),
    ("last-modified", ""),
    ("link", ""),
    ("location", ""),
    ("max-forwards", ""),
    ("proxy-authenticate", ""),
    ("proxy-authorization", ""),
    ("range", ""),
    ("referer", ""),
    ("refresh", ""),
    ("retry-after", ""),
    ("server", ""),
    ("set-cookie", ""),
    ("strict-transport-security", ""),
    ("transfer-encoding", ""),
    ("user-agent", ""),
    ("vary", ""),
    ("via", ""),
    ("www-authenticate", ""),
];

/// The Huffman code's length for each octet (RFC 7541 Appendix B). The code is canonical: the
/// codes follow from the lengths (shorter first, then by octet), and EOS is the 30-bit all-ones.
const HUFFMAN_LENGTHS: [u8; 256] = [
    13, 23, 28, 28, 28, 28, 28, 28, 28, 24, 30, 28, 28, 30, 28, 28, 28, 28, 28, 28, 28, 28, 30, 28, 28, 28, 28, 28, 28,
    28, 28, 28, 6, 10, 10, 12, 13, 6, 8, 11, 10, 10, 8, 11, 8, 6, 6, 6, 5, 5, 5, 6, 6, 6, 6, 6, 6, 6, 7, 8, 15, 6, 12,
    10, 13, 6, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 8, 7, 8, 13, 19, 13, 14, 6, 15, 5, 6,
    5, 6, 5, 6, 6, 6, 5, 7, 7, 6, 6, 6, 5, 6, 7, 6, 5, 5, 6, 7, 7, 7, 7, 7, 15, 11, 14, 13, 28, 20, 22, 20, 20, 22, 22,
    22, 23, 22, 23, 23, 23, 23, 23, 24, 23, 24, 24, 22, 23, 24, 23, 23, 23, 23, 21, 22, 23, 22, 23, 23, 24, 22, 21, 20,
    22, 22, 23, 23, 21, 23, 22, 22, 24, 21, 22, 23, 23, 21, 21, 22, 21, 23, 22, 23, 23, 20, 22, 22, 22, 23, 22, 22, 23,
    26, 26, 20, 19, 22, 23, 22, 25, 26, 26, 26, 27, 27, 26, 24, 25, 19, 21, 26, 27, 27, 26, 27, 24, 21, 21, 26, 26, 28,
    27, 27, 27, 20, 24, 20, 21, 22, 21, 21, 23, 22, 22, 25, 25, 24, 24, 26, 23, 26, 27, 26, 26, 27, 27, 27, 27, 27, 28,
    27, 27, 27, 27, 27, 26,
];

/// HPACK's decoder state: the dynamic table, newest first.
struct Decoder {
    table: std::collections::VecDeque<(String, String)>,
    size: usize,
    max: usize,
}

impl Decoder {
    fn new() -> Decoder {
        Decoder { table: std::collections::VecDeque::new(), size: 0, max: TABLE_SIZE }
    }

    fn entry(&self, i: usize) -> Result<(String, String), String> {
        match i {
            0 => Err("HPACK: index 0".into()),
            i if i <= STATIC.len() => Ok((STATIC[i - 1].0.to_string(), STATIC[i - 1].1.to_string())),
            i => self
                .table
                .get(i - STATIC.len() - 1)
                .cloned()
                .ok_or_else(|| format!("HPACK: index {i} is not in the table")),
        }
    }

    fn insert(&mut self, name: String, value: String) {
        self.size += name.len() + value.len() + 32;
        self.table.push_front((name, value));
        self.evict();
    }

    fn evict(&mut self) {
        while self.size > self.max {
            match self.table.pop_back() {
                Some((n, v)) => self.size -= n.len() + v.len() + 32,
                None => break,
            }
        }
    }

    fn decode(&mut self, mut b: &[u8]) -> Result<Vec<(String, String)>, String> {
        let mut out = Vec::new();
        while let Some(&first) = b.first() {
            if first & 0x80 != 0 {
                let i = read_integer(&mut b, 7)?;
                out.push(self.entry(i)?);
            } else if first & 0x40 != 0 {
                let (n, v) = self.literal(&mut b, 6)?;
                self.insert(n.clone(), v.clone());
                out.push((n, v));
            } else if first & 0x20 != 0 {
                let size = read_integer(&mut b, 5)?;
                if size > TABLE_SIZE {
                    return Err(format!("HPACK: a table size of {size}, over the {TABLE_SIZE} allowed"));
                }
                self.max = size;
                self.evict();
            } else {
                out.push(self.literal(&mut b, 4)?);
            }
        }
        Ok(out)
    }

    fn literal(&self, b: &mut &[u8], prefix: u32) -> Result<(String, String), String> {
        let i = read_integer(b, prefix)?;
        let name = if i == 0 { read_string(b)? } else { self.entry(i)?.0 };
        Ok((name, read_string(b)?))
    }
}

fn read_integer(b: &mut &[u8], n: u32) -> Result<usize, String> {
    let (&first, rest) = b.split_first().ok_or("HPACK: a truncated integer")?;
    *b = rest;
    let max = (1usize << n) - 1;
    let mut v = (first as usize) & max;
    if v < max {
        return Ok(v);
    }
    let mut shift = 0;
    loop {
        let (&byte, rest) = b.split_first().ok_or("HPACK: a truncated integer")?;
        *b = rest;
        v = v
            .checked_add(((byte & 0x7f) as usize).checked_shl(shift).ok_or("HPACK: an integer too large")?)
            .ok_or("HPACK: an integer too large")?;
        if byte & 0x80 == 0 {
            return Ok(v);
        }
        shift += 7;
        if shift > 28 {
            return Err("HPACK: an integer too large".into());
        }
    }
}

fn read_string(b: &mut &[u8]) -> Result<String, String> {
    let huffman = b.first().is_some_and(|f| f & 0x80 != 0);
    let len = read_integer(b, 7)?;
    let raw = b.get(..len).ok_or("HPACK: a truncated string")?;
    *b = &b[len..];
    let bytes = if huffman { huffman_decode(raw)? } else { raw.to_vec() };
    String::from_utf8(bytes).map_err(|_| "HPACK: a header that is not UTF-8".into())
}

/// Decodes a canonical Huffman string (RFC 7541 §5.2): the codes of each length are consecutive
/// numbers, in octet order, after the last code of the length before, shifted.
fn huffman_decode(raw: &[u8]) -> Result<Vec<u8>, String> {
    // first[l]: the first code of length l; start[l]: its index in `by_code`.
    let mut by_code: Vec<u8> = (0..=255u8).collect();
    by_code.sort_by_key(|&s| (HUFFMAN_LENGTHS[s as usize], s));
    let mut first = [0u32; 31];
    let mut count = [0u32; 31];
    let mut start = [0usize; 31];
    for &l in &HUFFMAN_LENGTHS {
        count[l as usize] += 1;
    }
    let (mut code, mut index) = (0u32, 0usize);
    for l in 1..31 {
        first[l] = code;
        start[l] = index;
        code = (code + count[l]) << 1;
        index += count[l] as usize;
    }
    let mut out = Vec::with_capacity(raw.len() * 8 / 5);
    let (mut acc, mut len) = (0u32, 0usize);
    for &byte in raw {
        for bit in (0..8).rev() {
            acc = (acc << 1) | u32::from((byte >> bit) & 1);
            len += 1;
            if len > 30 {
                return Err("HPACK: a Huffman code longer than 30 bits".into());
            }
            if count[len] > 0 && acc >= first[len] && acc - first[len] < count[len] {
                out.push(by_code[start[len] + (acc - first[len]) as usize]);
                acc = 0;
                len = 0;
            }
        }
    }
    // What is left must be the start of EOS: fewer than 8 bits, all ones (§5.2).
    if len >= 8 || acc != (1u32 << len) - 1 {
        return Err("HPACK: a Huffman string with bad padding".into());
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// RFC 7541 Appendix C.4.1: "www.example.com", Huffman-coded.
    #[test]
    fn huffman_strings_decode_as_rfc_7541_shows() {
        let raw = [0xf1, 0xe3, 0xc2, 0xe5, 0xf2, 0x3a, 0x6b, 0xa0, 0xab, 0x90, 0xf4, 0xff];
        assert_eq!(huffman_decode(&raw).unwrap(), b"www.example.com");
        // C.4.2: "no-cache".
        assert_eq!(huffman_decode(&[0xa8, 0xeb, 0x10, 0x64, 0x9c, 0xbf]).unwrap(), b"no-cache");
        assert!(huffman_decode(&[0xf1, 0x00]).is_err(), "padding that is not EOS's ones");
    }

    /// RFC 7541 Appendix C.3: three requests without Huffman, sharing the dynamic table.
    #[test]
    fn header_blocks_share_the_dynamic_table_as_rfc_7541_shows() {
        let mut d = Decoder::new();
        let first = d
            .decode(&[
                0x82, 0x86, 0x84, 0x41, 0x0f, b'w', b'w', b'w', b'.', b'e', b'x', b'a', b'm', b'p', b'l', b'e', b'.',
                b'c', b'o', b'm',
            ])
            .unwrap();
        assert_eq!(first[3], (":authority".to_string(), "www.example.com".to_string()));
        let second =
            d.decode(&[0x82, 0x86, 0x84, 0xbe, 0x58, 0x08, b'n', b'o', b'-', b'c', b'a', b'c', b'h', b'e']).unwrap();
        assert_eq!(second[3], (":authority".to_string(), "www.example.com".to_string()));
        assert_eq!(second[4], ("cache-control".to_string(), "no-cache".to_string()));
        assert_eq!(d.size, 110, "the table's size after C.3.2");
        assert!(d.decode(&[0xff, 0x80]).is_err() || d.decode(&[0xc5]).is_err(), "an index past the table");
    }

    #[test]
    fn integers_round_trip_across_their_prefix() {
        for n in [0usize, 30, 31, 127, 128, 1337, 1 << 20] {
            let mut out = Vec::new();
            integer(&mut out, 0, 5, n);
            let mut b = &out[..];
            assert_eq!(read_integer(&mut b, 5).unwrap(), n);
            assert!(b.is_empty());
        }
    }
}
