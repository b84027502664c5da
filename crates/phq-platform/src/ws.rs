//! The client side of a WebSocket (RFC 6455) as KubeVirt's vsock subresource speaks it: the
//! upgrade with subprotocol `plain.kubevirt.io`, then binary frames whose payloads are the
//! guest's byte stream (KubeVirt's `client-go/subresources/constants.go` names the subprotocol;
//! `pkg/virt-handler/rest/console.go`'s VSOCKHandler copies the stream both ways). `pipe` turns
//! the frames back into a byte stream the HTTP client reads and writes as if it were TCP.

use base64::Engine;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, DuplexStream};

/// The GUID RFC 6455 §1.3 appends to the key for `Sec-WebSocket-Accept`.
const GUID: &str = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11";
/// KubeVirt's subprotocol for a plain byte stream (client-go/subresources/constants.go).
pub const PLAIN: &str = "plain.kubevirt.io";

pub fn accept_of(key: &str) -> String {
    let mut h = sha1_smol::Sha1::new();
    h.update(key.as_bytes());
    h.update(GUID.as_bytes());
    base64::engine::general_purpose::STANDARD.encode(h.digest().bytes())
}

/// 16 random bytes, base64: the upgrade's `Sec-WebSocket-Key`.
pub fn new_key(random: &dyn Fn(&mut [u8])) -> String {
    let mut k = [0u8; 16];
    random(&mut k);
    base64::engine::general_purpose::STANDARD.encode(k)
}

/// Reads the upgrade's answer head (to `\r\n\r\n`, 16 KiB at most) and checks it is `101` with
/// the accept value and the subprotocol; the status line and headers otherwise, for the error.
/// Returns bytes read past the head (the first frames).
pub async fn read_upgrade<S: AsyncRead + Unpin>(io: &mut S, key: &str) -> Result<Vec<u8>, String> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    let end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        if buf.len() > 16 << 10 {
            return Err("the upgrade's answer has no end of head within 16 KiB".into());
        }
        let n = io.read(&mut chunk).await.map_err(|e| e.to_string())?;
        if n == 0 {
            return Err("the API server closed the connection during the upgrade".into());
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..end]).to_string();
    let mut lines = head.split("\r\n");
    let status = lines.next().unwrap_or("");
    let header = |name: &str| {
        head.split("\r\n")
            .skip(1)
            .filter_map(|l| l.split_once(':'))
            .find(|(k, _)| k.trim().eq_ignore_ascii_case(name))
            .map(|(_, v)| v.trim().to_string())
    };
    if status.split(' ').nth(1) != Some("101") {
        // The body (a Kubernetes Status, usually) says why; its first bytes are enough.
        let body = String::from_utf8_lossy(&buf[end..buf.len().min(end + 512)]).to_string();
        return Err(format!("{status}: {}", body.trim()));
    }
    if header("sec-websocket-accept").as_deref() != Some(accept_of(key).as_str()) {
        return Err("the upgrade's Sec-WebSocket-Accept does not answer our key".into());
    }
    if header("sec-websocket-protocol").as_deref() != Some(PLAIN) {
        return Err(format!("the upgrade chose subprotocol {:?}, not {PLAIN}", header("sec-websocket-protocol")));
    }
    Ok(buf[end..].to_vec())
}

/// A client frame: FIN, the opcode, masked (RFC 6455 §5.3: a client masks every frame).
pub fn frame(opcode: u8, payload: &[u8], mask: [u8; 4]) -> Vec<u8> {
    let mut f = Vec::with_capacity(payload.len() + 14);
    f.push(0x80 | opcode);
    match payload.len() {
        n if n < 126 => f.push(0x80 | n as u8),
        n if n <= 0xffff => {
            f.push(0x80 | 126);
            f.extend_from_slice(&(n as u16).to_be_bytes());
        }
        n => {
            f.push(0x80 | 127);
            f.extend_from_slice(&(n as u64).to_be_bytes());
        }
    }
    f.extend_from_slice(&mask);
    f.extend(payload.iter().enumerate().map(|(i, b)| b ^ mask[i % 4]));
    f
}

/// One parsed frame from the server: (opcode, payload, bytes it took), or None when `buf` does
/// not hold a whole frame yet. A frame longer than `max` is an error.
pub fn parse(buf: &[u8], max: usize) -> Result<Option<(u8, Vec<u8>, usize)>, String> {
    if buf.len() < 2 {
        return Ok(None);
    }
    let opcode = buf[0] & 0x0f;
    let masked = buf[1] & 0x80 != 0;
    let (len, mut at) = match buf[1] & 0x7f {
        126 if buf.len() >= 4 => (u16::from_be_bytes([buf[2], buf[3]]) as u64, 4),
        127 if buf.len() >= 10 => (u64::from_be_bytes(buf[2..10].try_into().map_err(|_| "frame length")?), 10),
        126 | 127 => return Ok(None),
        n => (n as u64, 2),
    };
    if len > max as u64 {
        return Err(format!("a frame of {len} bytes, over the cap of {max}"));
    }
    let mask = if masked {
        if buf.len() < at + 4 {
            return Ok(None);
        }
        let m = [buf[at], buf[at + 1], buf[at + 2], buf[at + 3]];
        at += 4;
        Some(m)
    } else {
        None
    };
    let end = at + len as usize;
    if buf.len() < end {
        return Ok(None);
    }
    let mut payload = buf[at..end].to_vec();
    if let Some(m) = mask {
        payload.iter_mut().enumerate().for_each(|(i, b)| *b ^= m[i % 4]);
    }
    Ok(Some((opcode, payload, end)))
}

/// Carries bytes between `local` (the HTTP client's side) and the upgraded connection: what the
/// client writes goes out as masked binary frames; binary and continuation frames' payloads come
/// back as bytes; a ping is answered; a close ends it. Returns when either side ends.
pub async fn pipe<S>(upstream: S, mut local: DuplexStream, first: Vec<u8>, max_frame: usize, random: fn(&mut [u8]))
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let (mut up_r, mut up_w) = tokio::io::split(upstream);
    let mut inbuf = first;
    let mut out = vec![0u8; 16 << 10];
    let mut chunk = vec![0u8; 16 << 10];
    loop {
        // Whole frames already read go to the client first.
        loop {
            match parse(&inbuf, max_frame) {
                Ok(Some((opcode, payload, used))) => {
                    inbuf.drain(..used);
                    match opcode {
                        0x0 | 0x2 if local.write_all(&payload).await.is_err() => return,
                        0x0 | 0x2 => {}
                        0x8 => return,
                        0x9 => {
                            let mut m = [0u8; 4];
                            random(&mut m);
                            if up_w.write_all(&frame(0xA, &payload, m)).await.is_err() {
                                return;
                            }
                        }
                        _ => {}
                    }
                }
                Ok(None) => break,
                Err(_) => return,
            }
        }
        tokio::select! {
            n = local.read(&mut out) => match n {
                Ok(0) | Err(_) => {
                    let mut m = [0u8; 4];
                    random(&mut m);
                    let _ = up_w.write_all(&frame(0x8, &[0x03, 0xe8], m)).await;
                    return;
                }
                Ok(n) => {
                    let mut m = [0u8; 4];
                    random(&mut m);
                    if up_w.write_all(&frame(0x2, &out[..n], m)).await.is_err() {
                        return;
                    }
                }
            },
            n = up_r.read(&mut chunk) => match n {
                Ok(0) | Err(_) => return,
                Ok(n) => inbuf.extend_from_slice(&chunk[..n]),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// RFC 6455 §1.3's own example.
    #[test]
    fn the_accept_value_is_rfc_6455s() {
        assert_eq!(accept_of("dGhlIHNhbXBsZSBub25jZQ=="), "s3pPLMBiTxaQ9kYGzzhZRbK+xOo=");
    }

    #[test]
    fn frames_round_trip_at_each_length_form() {
        for n in [0usize, 125, 126, 65535, 65536] {
            let payload: Vec<u8> = (0..n).map(|i| i as u8).collect();
            let f = frame(0x2, &payload, [1, 2, 3, 4]);
            let (op, got, used) = parse(&f, 1 << 20).unwrap().unwrap();
            assert_eq!((op, got.len(), used), (0x2, n, f.len()));
            assert_eq!(got, payload);
            assert!(parse(&f[..f.len() - 1], 1 << 20).unwrap().is_none());
        }
        assert!(parse(&frame(0x2, &[0; 100], [0; 4]), 99).is_err());
    }
}
