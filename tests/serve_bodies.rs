//! Every body is made at most once per snapshot, and the metrics only when scraped (the
//! renderings at the first scrape, each gzip at its first gzip scrape): the service's own
//! snapshot function over the fake NVML
//! (8 H100s, dcgm-exporter names on), published and served by the real HTTP endpoint on
//! 127.0.0.1, answers many scrapes of every kind with the same bytes and renders and compresses
//! nothing more; the gzipped bodies are the plain ones; the next snapshot is served whole. (A
//! file of its own: it sets the scenario in this process's environment and reads the process's
//! render counter, which no other test may move.)

mod common;

use common::*;
use phq_agent::collect::nvml::{Deadlines, Session};
use phq_agent::collect::NvmlSource;
use phq_agent::serve::{http, metrics, take_snapshot, Inputs, Shared};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::{Arc, RwLock};
use std::time::Duration;

const TOKEN: &str = "tok-bodies-0123456789abcdef";

/// One request on a connection of its own; (head, body) as bytes, the head lower-cased.
fn fetch(port: u16, method: &str, path: &str, headers: &str) -> (String, Vec<u8>) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAuthorization: Bearer {TOKEN}\r\n{headers}\r\n"
    )
    .unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n").expect("a response head");
    (String::from_utf8_lossy(&raw[..split]).to_ascii_lowercase(), raw[split + 4..].to_vec())
}

fn gunzip(body: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    flate2::read::GzDecoder::new(body).read_to_end(&mut out).expect("a gzip body");
    out
}

fn publish(shared: &Shared, p: phq_agent::serve::Published) {
    *shared.write().unwrap() = Some(Arc::new(p));
}

#[test]
fn scrapes_of_one_snapshot_are_its_bytes_and_render_nothing() {
    let lib = fake_nvml().to_path_buf();
    // This test is alone in its process (its own file), so setting the environment races nothing.
    std::env::set_var("PHQ_FAKE_NVML_SCENARIO", repo().join("examples/scenarios/hgx-8gpu-healthy.json"));
    let state = tempfile::tempdir().unwrap();
    let mut config = phq_agent::config::Config::default();
    config.agent.state_dir = state.path().to_path_buf();
    config.metrics.dcgm_compat = true;
    let inputs = Inputs {
        sysroot: repo().join("tests/fixtures/sysroots/hgx-8gpu-healthy"),
        nvml: NvmlSource::Session(Arc::new(Session::new(lib.to_str().unwrap(), Deadlines::default()))),
        config,
        token: Some(TOKEN.into()),
        control_token: None,
        started_at: phq_agent::snapshot::Timestamp::now(),
        probes: None,
        push: Default::default(),
        events: Default::default(),
        spool: None,
        nvml_budget: None,
        history: None,
        vsock_ca: None,
    };
    let shared: Shared = Arc::new(RwLock::new(None));
    let before = metrics::renders();
    let (p, _) = take_snapshot(&inputs, 1);
    assert_eq!(metrics::renders() - before, 0, "a snapshot renders and gzips nothing before a scrape asks");
    publish(&shared, p);

    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let listener = runtime.block_on(async { http::listen("127.0.0.1:0".parse().unwrap()) }).unwrap();
    let port = listener.local_addr().unwrap().port();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let (desk, _asks) = phq_agent::serve::recheck::Desk::new(phq_agent::serve::recheck::Limit {
        max: 0,
        window: std::time::Duration::from_secs(3600),
    });
    let endpoint = http::Endpoint { shared: shared.clone(), desk };
    let server = runtime.spawn(http::serve(listener, endpoint, None, async {
        let _ = stopped.await;
    }));

    let made = metrics::renders();
    let kinds = [
        ("text", ""),
        ("text gzip", "Accept-Encoding: gzip\r\n"),
        ("openmetrics", "Accept: application/openmetrics-text;version=1.0.0\r\n"),
        ("openmetrics gzip", "Accept: application/openmetrics-text;version=1.0.0\r\nAccept-Encoding: gzip\r\n"),
    ];
    let mut bodies = Vec::new();
    for (kind, headers) in kinds {
        let (head, first) = fetch(port, "GET", "/metrics", headers);
        assert!(head.starts_with("http/1.1 200"), "{kind}: {head}");
        assert_eq!(head.contains("content-encoding: gzip"), kind.ends_with("gzip"), "{kind}: {head}");
        for _ in 0..5 {
            assert!(fetch(port, "GET", "/metrics", headers).1 == first, "{kind}: a second scrape, other bytes");
        }
        bodies.push(first);
    }
    let (_, status) = fetch(port, "GET", "/v1/status", "");
    assert!(fetch(port, "GET", "/v1/status", "").1 == status, "/v1/status: the same bytes");
    assert_eq!(
        metrics::renders() - made,
        3,
        "rendered once, at the first scrape, and each format gzipped once, at its first gzip scrape; nothing else made"
    );
    let made = metrics::renders();

    let text = String::from_utf8(bodies[0].clone()).unwrap();
    assert!(text.contains("DCGM_FI_DEV_GPU_TEMP{") && text.contains("phq_gpu_temperature_celsius{"), "{text:.300}");
    assert!(gunzip(&bodies[1]) == bodies[0], "the gzipped text is the text");
    assert!(gunzip(&bodies[3]) == bodies[2], "the gzipped OpenMetrics is the OpenMetrics");
    assert!(String::from_utf8_lossy(&bodies[2]).trim_end().ends_with("# EOF"));

    // HEAD: GET's headers, no body; any other method is refused, and another path is not there.
    let (head, body) = fetch(port, "HEAD", "/metrics", "");
    assert!(head.starts_with("http/1.1 200"), "{head}");
    assert!(head.contains(&format!("content-length: {}", bodies[0].len())), "{head}");
    assert!(body.is_empty(), "HEAD answered with a body");
    let (head, _) = fetch(port, "POST", "/metrics", "Content-Length: 0\r\n");
    assert!(head.starts_with("http/1.1 405") && head.contains("allow: get,head"), "{head}");
    assert!(fetch(port, "GET", "/metricsx", "").0.starts_with("http/1.1 404"));

    // The next snapshot is made once and served whole; its metrics, again, when scraped.
    let (p, _) = take_snapshot(&inputs, 2);
    publish(&shared, p);
    assert_eq!(metrics::renders() - made, 0);
    assert!(fetch(port, "GET", "/metrics", "").0.starts_with("http/1.1 200"));
    assert_eq!(metrics::renders() - made, 1);
    let (_, status) = fetch(port, "GET", "/v1/status", "");
    let report: serde_json::Value = serde_json::from_slice(&status).unwrap();
    assert_eq!(report["seq"], 2);
    let _ = stop.send(());
    runtime.block_on(server).unwrap();
}
