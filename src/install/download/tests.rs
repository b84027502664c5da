//! Downloads against a real HTTP server on 127.0.0.1.

use super::*;
use std::io::Write;

#[test]
fn redirects_never_go_down_from_https_and_stop_after_ten() {
    assert!(redirect_allowed("https://a.example/k", "https://b.example/k", 0).is_ok());
    assert!(redirect_allowed("http://a.example/k", "http://b.example/k", 0).is_ok());
    assert!(redirect_allowed("http://a.example/k", "https://b.example/k", 0).is_ok());
    let e = redirect_allowed("https://a.example/k", "http://b.example/k", 0).unwrap_err().to_string();
    assert!(e.contains("from https down to http"), "{e}");
    assert!(redirect_allowed("HTTPS://a.example/k", "ftp://b.example/k", 0).is_err());
    assert!(redirect_allowed("https://a.example/k", "https://a.example/j", 10)
        .unwrap_err()
        .to_string()
        .contains("more than 10"));
}

/// A real HTTP server on 127.0.0.1: a body past the cap is refused, whether announced by
/// Content-Length or only sent; a redirect chain longer than ten is refused.
#[test]
fn downloads_are_capped_and_redirects_bounded() {
    use std::io::{BufRead, BufReader};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for conn in listener.incoming().flatten() {
            let mut conn = conn;
            let mut line = String::new();
            let mut reader = BufReader::new(conn.try_clone().unwrap());
            reader.read_line(&mut line).unwrap();
            loop {
                let mut h = String::new();
                if reader.read_line(&mut h).unwrap() == 0 || h == "\r\n" {
                    break;
                }
            }
            let path = line.split_whitespace().nth(1).unwrap_or("/").to_string();
            let _ = match path.as_str() {
                "/small" => conn.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nConnection: close\r\n\r\nhello"),
                "/announced" => {
                    conn.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 999999999\r\nConnection: close\r\n\r\n")
                }
                "/endless" => {
                    let _ = conn.write_all(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n");
                    let chunk = vec![b'x'; 64 * 1024];
                    // Bounded: 8 MiB, past the test's 1 MiB cap, then the server stops.
                    for _ in 0..128 {
                        if conn.write_all(&chunk).is_err() {
                            break;
                        }
                    }
                    Ok(())
                }
                p if p.starts_with("/loop") => conn.write_all(
                    format!(
                        "HTTP/1.1 302 Found\r\nLocation: /loop{}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
                        p.len()
                    )
                    .as_bytes(),
                ),
                _ => conn.write_all(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"),
            };
        }
    });
    let url = |p: &str| format!("http://127.0.0.1:{port}{p}");
    assert_eq!(download(&url("/small"), 1 << 20).unwrap(), b"hello");
    let e = download(&url("/announced"), 1 << 20).unwrap_err().to_string();
    assert!(e.contains("announces 999999999 bytes"), "{e}");
    let e = download(&url("/endless"), 1 << 20).unwrap_err().to_string();
    assert!(e.contains("runs past 1048576 bytes"), "{e}");
    let e = download(&url("/loop"), 1 << 20).unwrap_err().to_string();
    assert!(e.contains("more than 10 redirects"), "{e}");
    assert_eq!(download(&url("/nothing"), 1 << 20).unwrap_err().to_string(), "HTTP 404 Not Found");
}
