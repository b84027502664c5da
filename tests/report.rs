//! What a person sees: the GPU↔GPU matrix printed after `probe`'s findings, and the support
//! bundle's `report.html` — rendered again from the bundle by `phq-agent report`, and opened in
//! a real browser (headless Chromium). Mostly on the 8-GPU HGX fake whose GPU 2 → GPU 6 NVLink
//! path copies at 120 GB/s, under the 335 GB/s floor (`cuda-hgx-8gpu-slow-pair`); the timeline on
//! a fixture whose kernel log holds an Xid and SXids.

mod common;

use common::{fake_cuda, fake_nvml, repo};
use serde_json::Value;
use std::io::Read;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;

const SLOW: (usize, usize) = (2, 6);

/// The real binary over the 8-GPU fixture, the fake NVML and the fake CUDA driver with the slow
/// pair, its state in `dir`.
fn agent(dir: &Path, args: &[&str]) -> Command {
    let config = dir.join("config.toml");
    if !config.exists() {
        let state = dir.join("state");
        std::fs::write(&config, format!("[agent]\nstate_dir = {:?}\n", state.to_str().unwrap())).unwrap();
    }
    let scenario = |name: &str| repo().join("examples/scenarios").join(format!("{name}.json"));
    let mut c = Command::new(env!("CARGO_BIN_EXE_phq-agent"));
    c.args(args)
        .arg("--config")
        .arg(&config)
        .arg("--sysroot")
        .arg(repo().join("tests/fixtures/sysroots/hgx-8gpu-healthy"))
        .arg("--nvml-lib")
        .arg(fake_nvml())
        .arg("--cuda-lib")
        .arg(fake_cuda())
        .env("PHQ_FAKE_NVML_SCENARIO", scenario("hgx-8gpu-healthy"))
        .env("PHQ_FAKE_CUDA_SCENARIO", scenario("cuda-hgx-8gpu-slow-pair"))
        .env("PHQ_CUBLAS_LIB", fake_cuda())
        .env_remove("CUDA_DEVICE_ORDER")
        .env_remove("NO_COLOR")
        .env_remove("CLICOLOR_FORCE")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    c
}

fn text(out: &Output) -> (String, String) {
    (String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
}

/// The rows of the matrix printed under `title`: one row of cells per source GPU, split on
/// whitespace (the source's number first).
fn matrix_rows(stdout: &str, title: &str) -> Vec<Vec<String>> {
    let mut lines = stdout.lines().skip_while(|l| !l.contains(title));
    assert!(lines.next().is_some(), "no matrix titled {title:?} in:\n{stdout}");
    let head: Vec<String> = lines.next().unwrap().split_whitespace().map(str::to_string).collect();
    assert_eq!(
        head,
        (0..8).map(|n| n.to_string()).collect::<Vec<_>>(),
        "destinations across, as nvidia-smi numbers them"
    );
    lines.take(8).map(|l| l.split_whitespace().map(str::to_string).collect()).collect()
}

/// `probe` piped (as into `less` or a file): the bandwidth matrix, rows the source and columns the
/// destination, marks the one slow cell with a `*` and no escape sequence; the diagonal says
/// N/A; the latency matrix and the NVLink-scope line follow. With colour forced (what a terminal
/// gets), the same cell is red.
#[test]
fn the_slow_pair_is_marked_in_the_terminal_matrix() {
    let dir = tempfile::tempdir().unwrap();
    let out = agent(dir.path(), &["probe"]).output().unwrap();
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(!stdout.contains('\u{1b}'), "no colour into a pipe:\n{stdout}");
    let rows = matrix_rows(&stdout, "GPU↔GPU peer copy bandwidth (GB/s), GPU(row) -> GPU(column)");
    for (src, row) in rows.iter().enumerate() {
        assert_eq!(row[0], src.to_string(), "{row:?}");
        for (dst, cell) in row[1..].iter().enumerate() {
            let want = match (src, dst) {
                _ if src == dst => "N/A",
                p if p == SLOW => "120.0*",
                _ => "375.0",
            };
            assert_eq!(cell, want, "GPU {src} -> GPU {dst} in:\n{stdout}");
        }
    }
    let latency = matrix_rows(&stdout, "GPU↔GPU latency (ns)");
    assert!(latency.iter().flatten().all(|c| !c.ends_with('*')), "latency has no floor to mark");
    let findings_end = stdout.find("probe.nvlink-scope").unwrap();
    assert!(stdout.find("GPU↔GPU peer copy").unwrap() > findings_end, "the matrix comes after the findings");
    assert!(
        stdout.contains(
            "NVLink scope: 8 GPU(s), all-to-all over NVLink through NVSwitch, 18 links each, 55/56 pairs ≥ 335 GB/s"
        ),
        "{stdout}"
    );

    // The colours on the slow pair's two GPUs alone: the same slow cell, a quarter of the
    // matrix's copies (an 8-GPU quick probe is most of this test's time).
    let pair = ["probe", "--gpu", "2", "--gpu", "6"];
    let out = agent(dir.path(), &pair).env("CLICOLOR_FORCE", "1").output().unwrap();
    let (stdout, _) = text(&out);
    let red = "\u{1b}[1m\u{1b}[31m    120.0*\u{1b}[0m";
    assert_eq!(stdout.matches(red).count(), 1, "the slow cell, red and bold, once:\n{stdout}");
    assert_eq!(
        stdout.matches("\u{1b}[31m").count(),
        3,
        "red: the FAIL label, the slow cell and the verdict only:\n{stdout}"
    );

    // NO_COLOR wins over a forced colour (no-color.org): the marker alone.
    let out = agent(dir.path(), &pair).env("CLICOLOR_FORCE", "1").env("NO_COLOR", "1").output().unwrap();
    let (stdout, _) = text(&out);
    assert!(!stdout.contains('\u{1b}') && stdout.contains("120.0*"), "{stdout}");
}

/// A member of a bundle, read without extracting it.
fn member(bundle: &Path, name: &str) -> Vec<u8> {
    let gz = flate2::read::GzDecoder::new(std::fs::File::open(bundle).unwrap());
    let mut archive = tar::Archive::new(gz);
    for entry in archive.entries().unwrap() {
        let mut entry = entry.unwrap();
        if entry.path().unwrap().to_str() == Some(name) {
            let mut buf = Vec::new();
            entry.read_to_end(&mut buf).unwrap();
            return buf;
        }
    }
    panic!("no {name} in {}", bundle.display())
}

/// The slow-pair fake's bundle and its `report.html`.
struct SlowPairBundle {
    bundle: Vec<u8>,
    page: String,
}

/// `doctor --probe quick --bundle` on the slow-pair fake: a whole-board probe, run once per test
/// binary for the tests that read its bundle (the first to ask runs it, the other waits).
fn bundle_of_the_slow_pair() -> &'static SlowPairBundle {
    static BUNDLE: OnceLock<SlowPairBundle> = OnceLock::new();
    BUNDLE.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let bundle = dir.path().join("bundle.tar.gz");
        let out =
            agent(dir.path(), &["doctor", "--probe", "quick", "--bundle", bundle.to_str().unwrap()]).output().unwrap();
        let (stdout, stderr) = text(&out);
        assert_eq!(out.status.code(), Some(2), "{stderr}");
        // doctor --probe prints the matrix too, after its findings.
        let row = matrix_rows(&stdout, "GPU↔GPU peer copy bandwidth (GB/s)").swap_remove(SLOW.0);
        assert_eq!(row[1 + SLOW.1], "120.0*", "{stdout}");
        let page = String::from_utf8(member(&bundle, "report.html")).unwrap();
        SlowPairBundle { bundle: std::fs::read(&bundle).unwrap(), page }
    })
}

/// The page in a bundle is the one `phq-agent report` renders from the bundle's report.json on
/// another machine — the same bytes, from the same report — and it stands alone: no script, no
/// resource from anywhere. It holds the verdict, the failed finding with its remedy, the
/// machine, and the heat map with exactly the slow cell red.
#[test]
fn the_bundles_page_renders_the_same_from_the_bundle() {
    let SlowPairBundle { bundle, page } = bundle_of_the_slow_pair();
    // Elsewhere: only the bundle travels (no config, no fakes, no fixture).
    let elsewhere = tempfile::tempdir().unwrap();
    let copy = elsewhere.path().join("received.tar.gz");
    std::fs::write(&copy, bundle).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_phq-agent"))
        .args(["report", "received.tar.gz", "--output", "again.html"])
        .current_dir(elsewhere.path())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", text(&out).1);
    let again = std::fs::read_to_string(elsewhere.path().join("again.html")).unwrap();
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(elsewhere.path().join("again.html")).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600, "the page quotes the kernel log: the owner's alone, as the bundle is");
    assert!(again == *page, "phq-agent report renders the bundle's page differently");
    // And from the bundle's report.json alone (what /v1/status or a push carries).
    std::fs::write(elsewhere.path().join("report.json"), member(&copy, "report.json")).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_phq-agent"))
        .args(["report", "report.json"])
        .current_dir(elsewhere.path())
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stdout) == page.as_str(), "the report's JSON renders another page");

    let report: Value = serde_json::from_slice(&member(&copy, "report.json")).unwrap();
    for bad in ["<script", "<link", "<img", "<iframe", "@import", "url(", " src=", " href="] {
        assert!(!page.contains(bad), "the page must stand alone, but holds {bad:?}");
    }
    assert!(page.contains("Content-Security-Policy\" content=\"default-src 'none'"));
    assert!(page.contains("<p id=\"verdict\" class=\"verdict health-unhealthy\">Unhealthy: 1 failed,"), "verdict");
    assert!(page.contains(&format!("<dd>{}</dd>", report["agent"]["agent_id"].as_str().unwrap())), "the VM");
    assert!(page.contains("<dd>580.82.07 (open kernel modules)</dd>"), "the driver");
    assert!(page.contains("<dd>12.4.1</dd>"), "CUDA");
    let failed = report["findings"].as_array().unwrap().iter().find(|f| f["severity"] == "fail").unwrap();
    assert!(page.contains(&format!("<p class=\"summary\">{}</p>", failed["summary"].as_str().unwrap())));
    assert!(page.contains(&format!("<p class=\"remedy\">→ {}</p>", failed["remedy"].as_str().unwrap())));
    // Every finding is on the page.
    let articles = page.matches("<article class=\"finding").count();
    assert_eq!(articles, report["findings"].as_array().unwrap().len());
    let slow: Vec<&str> = page.match_indices("<td class=\"cell slow\"").map(|(i, _)| &page[i..i + 80]).collect();
    assert_eq!(slow.len(), 1, "one red cell in the heat map: {slow:?}");
    assert!(slow[0].contains(&format!("data-src=\"{}\" data-dst=\"{}\"", SLOW.0, SLOW.1)), "{slow:?}");
}

/// Hostile text in a report — a kernel log line, a file or NVML can put anything in a finding —
/// is shown as text, never as markup.
#[test]
fn hostile_strings_in_a_finding_are_escaped() {
    let dir = tempfile::tempdir().unwrap();
    let out = agent(dir.path(), &["doctor", "--json"]).output().unwrap();
    let mut report: Value = serde_json::from_slice(&out.stdout).unwrap();
    let hostile = "<script>alert(1)</script>\"><img src=x onerror=alert(2)>'</pre></td>&amp;";
    report["host"]["hostname"] = hostile.into();
    report["findings"].as_array_mut().unwrap().push(serde_json::json!({
        "id": hostile, "severity": "fail", "gpu": hostile, "summary": hostile, "detail": hostile,
        "remedy": hostile, "evidence": { hostile: hostile },
    }));
    let path = dir.path().join("hostile.json");
    std::fs::write(&path, serde_json::to_vec(&report).unwrap()).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_phq-agent")).arg("report").arg(&path).output().unwrap();
    let (page, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    let escaped = "&lt;script&gt;alert(1)&lt;/script&gt;&quot;&gt;&lt;img src=x onerror=alert(2)&gt;&#39;&lt;/pre&gt;&lt;/td&gt;&amp;amp;";
    // hostname (title, heading, machine), the finding's id (twice), gpu, summary, detail, remedy.
    assert_eq!(page.matches(escaped).count(), 9, "{page}");
    for tag in ["<script", "<img"] {
        assert!(!page.contains(tag), "{tag} got through:\n{page}");
    }
    assert_eq!(page.matches("<pre>").count(), page.matches("</pre>").count());
    // In the evidence the text is JSON first (its quotes escaped as \"), then HTML.
    assert!(page.contains("&lt;script&gt;alert(1)&lt;/script&gt;\\&quot;&gt;"), "{page}");
}

/// The page's timeline holds the Xid a GPU reported and the NVSwitches' SXids (both from the
/// kernel log of `hgx-8gpu-sxid`), and its install section the installer's journal as the report
/// carries it.
#[test]
fn the_page_has_the_xid_and_sxid_timeline_and_the_install_journal() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_phq-agent"))
        .args(["doctor", "--json", "--sysroot"])
        .arg(repo().join("tests/fixtures/sysroots/hgx-8gpu-sxid"))
        .arg("--config")
        .arg(repo().join("tests/fixtures/config/empty/config.toml"))
        .env_remove("PHQ_NVML_LIB")
        .output()
        .unwrap();
    let mut report: Value = serde_json::from_slice(&out.stdout).unwrap();
    report["install"] = serde_json::json!({
        "schema": "phq.install/v1", "status": "reboot-required", "plan": "driver 580 (open), CUDA 12.9",
        "started_at": "2026-12-01T10:00:00.000Z", "updated_at": "2026-12-01T10:04:00.000Z",
        "steps": { "nvidia-repository": { "finished_at": "2026-12-01T10:01:00.000Z", "hash": "ab12", "seconds": 3.5 } },
        "reboot_pending_since": "9f3c", "reboot_reason": "the driver's kernel modules", "reboots": 0,
        "error": null, "findings": [],
    });
    let path = dir.path().join("report.json");
    std::fs::write(&path, serde_json::to_vec(&report).unwrap()).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_phq-agent")).arg("report").arg(&path).output().unwrap();
    let (page, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    let timeline =
        &page[page.find("<section id=\"timeline\">").unwrap()..page.find("<section id=\"install\">").unwrap()];
    assert!(timeline.contains("<td>Xid 74</td><td>0000:0a:00.0</td><td>1</td><td>NVLINK Error</td>"), "{timeline}");
    assert!(
        timeline.contains("<td>SXid 20034</td><td>0000:11:00.0</td><td>1</td><td>LTSSM Fault Up</td><td>fatal</td>"),
        "{timeline}"
    );
    assert!(timeline.contains("<td>SXid 12028</td><td>0000:14:00.0</td>"), "{timeline}");
    let install = &page[page.find("<section id=\"install\">").unwrap()..];
    assert!(install.contains("<dt>status</dt><dd>reboot-required</dd>"), "{install}");
    assert!(install.contains("<td>nvidia-repository</td>"), "{install}");
    assert!(page.contains("<p class=\"muted\">No probe ran.</p>"), "the heat map's place says why it is empty");
}

/// A PNG's pixels as RGB (8-bit RGB or RGBA, not interlaced: what Chromium writes), decoded
/// here with the zlib the agent already links (PNG specification, 3rd edition: chunks, IDAT,
/// filters 0–4).
fn png_rgb(bytes: &[u8]) -> (usize, usize, Vec<[u8; 3]>) {
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "not a PNG");
    let (mut pos, mut idat, mut head) = (8, Vec::new(), None);
    while pos + 8 <= bytes.len() {
        let len = u32::from_be_bytes(bytes[pos..pos + 4].try_into().unwrap()) as usize;
        let kind = &bytes[pos + 4..pos + 8];
        let data = &bytes[pos + 8..pos + 8 + len];
        match kind {
            b"IHDR" => head = Some(data.to_vec()),
            b"IDAT" => idat.extend_from_slice(data),
            _ => {}
        }
        pos += 12 + len;
    }
    let head = head.expect("IHDR");
    let w = u32::from_be_bytes(head[0..4].try_into().unwrap()) as usize;
    let h = u32::from_be_bytes(head[4..8].try_into().unwrap()) as usize;
    let (depth, color, interlace) = (head[8], head[9], head[12]);
    assert!(depth == 8 && (color == 2 || color == 6) && interlace == 0, "PNG kind {depth}/{color}/{interlace}");
    let bpp = if color == 6 { 4 } else { 3 };
    let mut raw = Vec::new();
    flate2::read::ZlibDecoder::new(&idat[..]).read_to_end(&mut raw).unwrap();
    let stride = w * bpp;
    let mut prev = vec![0u8; stride];
    let mut px = Vec::with_capacity(w * h);
    for y in 0..h {
        let line = &raw[y * (stride + 1)..(y + 1) * (stride + 1)];
        let mut cur = line[1..].to_vec();
        for i in 0..stride {
            let a = if i >= bpp { cur[i - bpp] as i16 } else { 0 };
            let b = prev[i] as i16;
            let c = if i >= bpp { prev[i - bpp] as i16 } else { 0 };
            let add = match line[0] {
                0 => 0,
                1 => a,
                2 => b,
                3 => (a + b) / 2,
                4 => {
                    let p = a + b - c;
                    let (pa, pb, pc) = ((p - a).abs(), (p - b).abs(), (p - c).abs());
                    if pa <= pb && pa <= pc {
                        a
                    } else if pb <= pc {
                        b
                    } else {
                        c
                    }
                }
                f => panic!("PNG filter {f}"),
            };
            cur[i] = cur[i].wrapping_add(add as u8);
        }
        px.extend(cur.chunks(bpp).map(|p| [p[0], p[1], p[2]]));
        prev = cur;
    }
    (w, h, px)
}

/// Headless Chromium opens the page of the slow-pair bundle: the rendered DOM holds the verdict,
/// the failed finding and the 8 × 8 heat map with the slow cell; the screenshot (kept as
/// target/report-page/report.png) shows that cell red — one cell-sized rectangle of the slow
/// colour, and no other pixel of it.
#[test]
fn the_page_renders_in_chromium() {
    if !common::needs(&[("chromium", "chromium")]) {
        return;
    }
    let page = &bundle_of_the_slow_pair().page;
    let keep = repo().join("target/report-page");
    std::fs::create_dir_all(&keep).unwrap();
    let html = keep.join("report.html");
    std::fs::write(&html, page).unwrap();
    let png = keep.join("report.png");
    let _ = std::fs::remove_file(&png);
    let url = format!("file://{}", html.display());
    let chromium = |args: &[&str]| {
        // A profile of its own, so parallel runs do not share one; root needs --no-sandbox.
        let profile = tempfile::tempdir().unwrap();
        let out = Command::new("timeout")
            .args(["120", "chromium", "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"])
            .arg(format!("--user-data-dir={}", profile.path().display()))
            .args(["--force-color-profile=srgb", "--force-device-scale-factor=1"])
            .args(args)
            .arg(&url)
            .output()
            .unwrap();
        assert!(out.status.success(), "chromium {args:?}: {}", text(&out).1);
        out
    };

    let dom = String::from_utf8(chromium(&["--dump-dom"]).stdout).unwrap();
    assert!(dom.contains("Unhealthy: 1 failed, 0 warning(s)"), "the verdict is not in the rendered DOM");
    assert!(dom.contains("slowest NVLink peer copy 120 GB/s (to GPU 6), below the floor of 335 GB/s"));
    let heat = &dom[dom.find("<table class=\"heat\" id=\"bandwidth\">").expect("the heat map")..];
    let heat = &heat[..heat.find("</table>").unwrap()];
    assert_eq!(heat.matches("<tr>").count(), 9, "a header and 8 rows");
    assert_eq!(heat.matches("<td ").count(), 64, "8 × 8 cells");
    assert_eq!(heat.matches("class=\"cell slow\"").count(), 1);

    chromium(&["--window-size=1200,2400", &format!("--screenshot={}", png.display())]);
    let (w, h, px) = png_rgb(&std::fs::read(&png).unwrap());
    assert_eq!((w, h), (1200, 2400));
    let red: Vec<(usize, usize)> =
        px.iter().enumerate().filter(|(_, p)| **p == [211, 47, 47]).map(|(i, _)| (i % w, i / w)).collect();
    assert!(!red.is_empty(), "no red cell in {} (the heat map below the window?)", png.display());
    let (x0, x1) = (red.iter().map(|p| p.0).min().unwrap(), red.iter().map(|p| p.0).max().unwrap());
    let (y0, y1) = (red.iter().map(|p| p.1).min().unwrap(), red.iter().map(|p| p.1).max().unwrap());
    let (cw, ch) = (x1 - x0 + 1, y1 - y0 + 1);
    assert!((40..200).contains(&cw) && (15..60).contains(&ch), "the red is not cell-sized: {cw}×{ch}");
    // Its text (white) sits inside it: most of the box, not all, is red.
    assert!(red.len() * 10 > cw * ch * 6, "the red is not one rectangle: {} pixels in {cw}×{ch}", red.len());
}
