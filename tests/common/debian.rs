//! A real Debian for the installer and packaging tests: a debootstrapped bookworm root (cached
//! under target/), stand-in NVIDIA packages built with dpkg-deb under their real names and
//! versions, a flat repository signed with a fresh test key, and a small HTTP server on
//! 127.0.0.1 that serves it (and takes POSTs, as a platform double).
//!
//! The stand-ins carry NVIDIA's R580 names and versions and nothing else: the keyring, the branch
//! pinning package (`nvidia-driver-pinning-580`, whose stand-in pins the driver packages to 580.*
//! in an apt preferences file), the open DKMS driver (whose postinst takes two seconds, like a
//! build, with a marker file while it runs), `nvidia-driver-cuda`, the persistence daemon and the
//! fabric manager with their units, NSCQ (unversioned names from 580 on), the CUDA 12.9 toolkit,
//! NCCL's runtime built for several CUDA releases (`libnccl2`) and a CUDA 12.8 toolkit that none
//! is built for, the headers. A newer branch (590) and a newer 580 fabric manager are in the repository too, to
//! prove the branch pin and the exact fabric-manager match. Beside it, a stand-in of Debian's own
//! archive with `nvidia-support` in contrib, which the driver needs.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The driver version the stand-ins carry.
pub const STANDIN_DRIVER: &str = "580.82.07";
/// NCCL's builds in the stand-in repositories (`version-release` on EL), and the one the
/// installer must choose for the CUDA 12.9 toolkit. None is built for CUDA 12.8, whose toolkit
/// the Debian repository carries too.
pub const NCCL_BUILDS: &[&str] = &["2.26.5-1+cuda12.9", "2.27.3-1+cuda12.9", "2.27.7-1+cuda12.4", "2.28.3-1+cuda13.0"];
pub const NCCL_FOR_TOOLKIT: &str = "2.27.3-1+cuda12.9";

pub fn target_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target")
}

/// Root and the tools, else a skip (a failure in CI, which has them).
#[track_caller]
pub fn runnable(what: &str, tools: &[&str]) -> bool {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    let missing: Vec<&str> = tools.iter().copied().filter(|t| !super::have(t)).collect();
    if root && missing.is_empty() {
        return true;
    }
    let mut why = vec![];
    if !root {
        why.push("root".to_string());
    }
    if !missing.is_empty() {
        why.push(format!("{} (scripts/test installs them)", missing.join(", ")));
    }
    super::skip(&format!("{what} needs {}", why.join(" and ")));
    false
}

/// The Debian mirror of this machine's own apt sources (`scripts/debian-mirror`; the variable
/// `PHQ_DEBIAN_MIRROR` overrides it), so that no mirror host is written in the repository.
pub fn debian_mirror() -> String {
    sh(super::repo().join("scripts/debian-mirror").to_str().unwrap(), &[]).trim().to_string()
}

pub fn sh(program: &str, args: &[&str]) -> String {
    let out = Command::new(program).args(args).output().unwrap_or_else(|e| panic!("{program}: {e}"));
    assert!(out.status.success(), "{program} {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The debootstrapped root `name` of tests/fixtures/debian-roots (`debootstrap --variant=minbase
/// --include=… bookworm`), built once into target/phq-debian/<name> and kept (tests copy it). A
/// lock file keeps two test binaries — or a test and scripts/debian-roots, which .ci/run runs in
/// the background — from building it at once; a root built with another include list is built
/// again.
pub fn debootstrap_cached(name: &str) -> PathBuf {
    let list = std::fs::read_to_string(super::repo().join("tests/fixtures/debian-roots")).unwrap();
    let include = list
        .lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| {
            let mut w = l.split_whitespace();
            (w.next()? == name).then(|| w.next().map(str::to_string))?
        })
        .unwrap_or_else(|| panic!("tests/fixtures/debian-roots has no root {name}"));
    let dir = target_dir().join("phq-debian");
    std::fs::create_dir_all(&dir).unwrap();
    let lock = std::fs::File::create(dir.join(format!(".{name}.lock"))).unwrap();
    lock.lock().unwrap();
    let base = dir.join(name);
    let same = std::fs::read_to_string(base.join(".phq-include")).is_ok_and(|i| i == include);
    if !base.join(".phq-complete").exists() || !same {
        let tmp = dir.join(format!("{name}.tmp"));
        let _ = std::fs::remove_dir_all(&tmp);
        let started = Instant::now();
        let mirror = debian_mirror();
        sh(
            "debootstrap",
            &["--variant=minbase", &format!("--include={include}"), "bookworm", tmp.to_str().unwrap(), &mirror],
        );
        std::fs::write(tmp.join(".phq-include"), &include).unwrap();
        std::fs::write(tmp.join(".phq-complete"), "").unwrap();
        let _ = std::fs::remove_dir_all(&base);
        std::fs::rename(&tmp, &base).unwrap();
        eprintln!("timing: debootstrap of {name} took {:.0} s", started.elapsed().as_secs_f64());
    }
    base
}

pub struct Deb<'a> {
    pub name: &'a str,
    pub version: &'a str,
    pub depends: &'a str,
    pub files: Vec<(String, Vec<u8>)>,
    pub postinst: &'a str,
}

pub fn build_deb(out: &Path, d: &Deb) {
    let dir = tempfile::tempdir().unwrap();
    let debian = dir.path().join("DEBIAN");
    std::fs::create_dir_all(&debian).unwrap();
    let mut control = format!(
        "Package: {}\nVersion: {}\nArchitecture: all\nMaintainer: phq-agent tests <tests@phq.invalid>\nDescription: stand-in for {} (phq-agent install test)\n",
        d.name, d.version, d.name
    );
    if !d.depends.is_empty() {
        control.push_str(&format!("Depends: {}\n", d.depends));
    }
    std::fs::write(debian.join("control"), control).unwrap();
    if !d.postinst.is_empty() {
        let p = debian.join("postinst");
        std::fs::write(&p, format!("#!/bin/sh\nset -e\n{}\n", d.postinst)).unwrap();
        sh("chmod", &["0755", p.to_str().unwrap()]);
    }
    for (path, data) in &d.files {
        let f = dir.path().join(path.trim_start_matches('/'));
        std::fs::create_dir_all(f.parent().unwrap()).unwrap();
        std::fs::write(f, data).unwrap();
    }
    let file = out.join(format!("{}_{}_all.deb", d.name, d.version));
    sh("dpkg-deb", &["--root-owner-group", "-Zgzip", "--build", dir.path().to_str().unwrap(), file.to_str().unwrap()]);
}

pub fn unit(desc: &str) -> Vec<u8> {
    format!("[Unit]\nDescription={desc} (stand-in)\n[Service]\nExecStart=/bin/true\n[Install]\nWantedBy=multi-user.target\n").into_bytes()
}

/// The signed flat repository `<root>/debian12/x86_64/`, as NVIDIA lays it out. Returns the
/// key's fingerprint.
/// NVIDIA's flat repository layout `<root>/debian12/x86_64/` holding the stand-ins, signed
/// with a fresh test key; `kernel` names the headers package. Returns the key's fingerprint.
/// What the stand-in keyring package's postinst would leave, and the extra source it carries:
/// the installer must leave neither (it takes the key out of the package and never installs it).
pub const KEYRING_POSTINST_MARKER: &str = "var/tmp/phq-keyring-postinst-ran";
pub const KEYRING_EXTRA_SOURCE: &str = "etc/apt/sources.list.d/phq-keyring-extra.list";

pub fn build_repo(root: &Path, kernel: &str) -> String {
    let repo = root.join("debian12/x86_64");
    std::fs::create_dir_all(&repo).unwrap();
    let gnupg = root.join(".gnupg");
    std::fs::create_dir_all(&gnupg).unwrap();
    sh("chmod", &["0700", gnupg.to_str().unwrap()]);
    let g = gnupg.to_str().unwrap();
    sh(
        "gpg",
        &[
            "--homedir",
            g,
            "--batch",
            "--passphrase",
            "",
            "--quick-gen-key",
            "phq test repository <repo@phq.invalid>",
            "ed25519",
            "sign",
            "never",
        ],
    );
    let colons = sh("gpg", &["--homedir", g, "--with-colons", "--fingerprint"]);
    let fpr = colons.lines().find(|l| l.starts_with("fpr:")).unwrap().split(':').nth(9).unwrap().to_string();
    let key = Command::new("gpg").args(["--homedir", g, "--export", &fpr]).output().unwrap().stdout;
    assert!(!key.is_empty());

    let v = |s: &str| format!("{s}-1");
    let d580 = v(STANDIN_DRIVER);
    let fm_new = v("580.95.05");
    let headers = format!("linux-headers-{kernel}");
    let module = standin_module(root, STANDIN_DRIVER);
    let keyring_postinst = format!("touch /{KEYRING_POSTINST_MARKER}");
    let dkms_postinst = format!("touch /tmp/phq-dkms-building; sleep 2; depmod {kernel}; rm -f /tmp/phq-dkms-building");
    let headers_postinst = format!(
        "mkdir -p /lib/modules/{kernel} && ln -sfn /usr/src/linux-headers-{kernel} /lib/modules/{kernel}/build"
    );
    let debs = vec![
        Deb {
            name: "cuda-keyring",
            version: "1.1-1",
            depends: "",
            files: vec![
                ("usr/share/keyrings/cuda-archive-keyring.gpg".into(), key.clone()),
                (
                    "etc/apt/sources.list.d/cuda-debian12-x86_64.list".into(),
                    b"deb [signed-by=/usr/share/keyrings/cuda-archive-keyring.gpg] https://developer.download.nvidia.com/compute/cuda/repos/debian12/x86_64/ /\n".to_vec(),
                ),
                // What a hostile mirror could add beside the genuine key: a source of its own.
                (KEYRING_EXTRA_SOURCE.into(), b"deb [trusted=yes] http://127.0.0.1:9/evil ./\n".to_vec()),
            ],
            // ... and a maintainer script, which would run as root under `dpkg -i`.
            postinst: &keyring_postinst,
        },
        Deb {
            name: "nvidia-driver-pinning-580",
            version: "580-1",
            depends: "",
            files: vec![(
                "etc/apt/preferences.d/nvidia-driver-pinning-580".into(),
                b"Package: nvidia-* libnvidia-* cuda-drivers*\nPin: version 580.*\nPin-Priority: 1000\n".to_vec(),
            )],
            postinst: "",
        },
        Deb {
            name: "nvidia-kernel-open-dkms",
            version: &d580,
            depends: "",
            files: vec![
                ("usr/src/nvidia-580.82.07/dkms.conf".into(), b"PACKAGE_NAME=nvidia\n".to_vec()),
                // What DKMS would build: a module modinfo reads the version of (the installer's
                // boot-safety gate asks for it before rebooting).
                (format!("lib/modules/{kernel}/updates/dkms/nvidia.ko"), module),
            ],
            // A DKMS build takes a while; the test's kill -9 lands in the middle of it, while
            // the marker exists. Then depmod, as DKMS runs it, so modinfo -k finds the module.
            postinst: &dkms_postinst,
        },
        Deb { name: "nvidia-kernel-open-dkms", version: "590.44.01-1", depends: "", files: vec![], postinst: "" },
        Deb {
            name: "nvidia-persistenced",
            version: &d580,
            depends: "",
            files: vec![("lib/systemd/system/nvidia-persistenced.service".into(), unit("NVIDIA Persistence Daemon"))],
            postinst: "",
        },
        // The compute-only user space (NVIDIA's compute-only install: `nvidia-driver-cuda` beside
        // the open DKMS module); its 590 twin proves the pinning package holds it on 580 too.
        // Its dependency on `nvidia-support` is Debian's packaging (`libcuda1` depends on it), and
        // `nvidia-support` lives in the Debian archive's contrib (below): without that component
        // apt cannot install the driver.
        Deb {
            name: "nvidia-driver-cuda",
            version: &d580,
            depends: "nvidia-persistenced (>= 580), nvidia-support",
            files: vec![],
            postinst: "",
        },
        Deb { name: "nvidia-driver-cuda", version: "590.44.01-1", depends: "", files: vec![], postinst: "" },
        Deb {
            name: "nvidia-fabricmanager",
            version: &d580,
            depends: "",
            files: vec![("lib/systemd/system/nvidia-fabricmanager.service".into(), unit("NVIDIA fabric manager"))],
            postinst: "",
        },
        Deb {
            name: "nvidia-fabricmanager",
            version: &fm_new,
            depends: "",
            files: vec![("lib/systemd/system/nvidia-fabricmanager.service".into(), unit("NVIDIA fabric manager"))],
            postinst: "",
        },
        Deb { name: "libnvidia-nscq", version: &d580, depends: "", files: vec![], postinst: "" },
        Deb { name: "libnvidia-nscq", version: &fm_new, depends: "", files: vec![], postinst: "" },
        Deb {
            name: "cuda-toolkit-12-9",
            version: "12.9.1-1",
            depends: "",
            files: vec![("usr/local/cuda-12.9/version.json".into(), br#"{"cuda":{"name":"CUDA SDK","version":"12.9.1"}}"#.to_vec())],
            postinst: "sleep 1",
        },
    ];
    // NCCL's runtime as NVIDIA's repository versions it, one build per CUDA release: the
    // newest of CUDA 12.9's (`NCCL_FOR_TOOLKIT`) is the one to install, not an older 12.9 one,
    // not a newer one for CUDA 12.4, and not CUDA 13.0's, the newest there is (apt's own
    // candidate). The CUDA 12.8 toolkit has no NCCL build here: NCCL is skipped, with a warning.
    let debs: Vec<Deb> = debs
        .into_iter()
        .chain(NCCL_BUILDS.iter().map(|v| Deb {
            name: "libnccl2",
            version: v,
            depends: "",
            files: vec![],
            postinst: "",
        }))
        .chain([Deb { name: "cuda-toolkit-12-8", version: "12.8.1-1", depends: "", files: vec![], postinst: "" }])
        .collect();
    for d in &debs {
        build_deb(&repo, d);
    }
    // The keyring .deb is what the installer fetches by name; NVIDIA serves it beside the index.
    let packages = Command::new("apt-ftparchive").arg("packages").arg(".").current_dir(&repo).output().unwrap();
    std::fs::write(repo.join("Packages"), &packages.stdout).unwrap();
    let release = Command::new("apt-ftparchive").arg("release").arg(".").current_dir(&repo).output().unwrap();
    std::fs::write(repo.join("Release"), &release.stdout).unwrap();
    clearsign(g, &repo);
    // Debian's own packages, in the archive's main: the running kernel's headers and image, and
    // its flavour's metas, which depend on them (Debian's archive carries one ABI per flavour).
    let flavour = kernel.splitn(3, '-').nth(2).unwrap_or("amd64");
    let (hmeta, imeta, image) =
        (format!("linux-headers-{flavour}"), format!("linux-image-{flavour}"), format!("linux-image-{kernel}"));
    let main = vec![
        Deb {
            name: &headers,
            version: "6.1.112-1",
            depends: "",
            files: vec![(format!("usr/src/linux-headers-{kernel}/Makefile"), b"# stand-in\n".to_vec())],
            postinst: &headers_postinst,
        },
        // The lowest version there is: where a real kernel image is installed (the VM test), it
        // stays.
        Deb { name: &image, version: "0~phq-1", depends: "", files: vec![], postinst: "" },
        Deb { name: &hmeta, version: "6.1.112-1", depends: &headers, files: vec![], postinst: "" },
        Deb { name: &imeta, version: "6.1.112-1", depends: &image, files: vec![], postinst: "" },
    ];
    build_archive(root, g, &key, main);
    fpr
}

/// `dir/InRelease`: `dir/Release` clear-signed with the test key, as apt reads a signed index.
fn clearsign(gnupg: &str, dir: &Path) {
    sh(
        "gpg",
        &[
            "--homedir",
            gnupg,
            "--batch",
            "--yes",
            "--clearsign",
            "-o",
            dir.join("InRelease").to_str().unwrap(),
            dir.join("Release").to_str().unwrap(),
        ],
    );
}

/// Where a guest keeps the stand-in Debian archive's key, and the source line that names it.
pub const ARCHIVE_KEYRING: &str = "etc/apt/keyrings/phq-test-debian-archive.gpg";

/// A stand-in of Debian's own archive at `<root>/debian` (`dists/bookworm/{main,contrib,
/// non-free-firmware}`), signed with the same test key (kept as `<root>/archive-key.gpg`):
/// `contrib` holds `nvidia-support`, which the stand-in driver depends on as Debian's packaging
/// does, and `non-free-firmware` the GSP firmware package, both at bookworm's own versions;
/// `main` the kernel's packages. A guest whose source lists `main` alone cannot install the
/// driver until the installer adds the other two.
fn build_archive(root: &Path, gnupg: &str, key: &[u8], main: Vec<Deb>) {
    let archive = root.join("debian");
    let parts: [(&str, Vec<Deb>); 3] = [
        ("main", main),
        (
            "contrib",
            vec![Deb {
                name: "nvidia-support",
                version: "20220217+3~deb12u1",
                depends: "",
                files: vec![],
                postinst: "",
            }],
        ),
        (
            "non-free-firmware",
            vec![Deb {
                name: "firmware-nvidia-gsp",
                version: "535.261.03-1",
                depends: "",
                files: vec![],
                postinst: "",
            }],
        ),
    ];
    for (component, debs) in &parts {
        let pool = archive.join("pool").join(component);
        std::fs::create_dir_all(&pool).unwrap();
        for d in debs {
            build_deb(&pool, d);
        }
        let index = archive.join("dists/bookworm").join(component).join("binary-amd64");
        std::fs::create_dir_all(&index).unwrap();
        let packages = Command::new("apt-ftparchive")
            .args(["packages", &format!("pool/{component}")])
            .current_dir(&archive)
            .output()
            .unwrap();
        assert!(packages.status.success());
        std::fs::write(index.join("Packages"), &packages.stdout).unwrap();
    }
    let release = Command::new("apt-ftparchive")
        .args([
            "-o",
            "APT::FTPArchive::Release::Suite=bookworm",
            "-o",
            "APT::FTPArchive::Release::Codename=bookworm",
            "-o",
            "APT::FTPArchive::Release::Components=main contrib non-free-firmware",
            "-o",
            "APT::FTPArchive::Release::Architectures=amd64",
            "release",
            "dists/bookworm",
        ])
        .current_dir(&archive)
        .output()
        .unwrap();
    assert!(release.status.success());
    let dists = archive.join("dists/bookworm");
    std::fs::write(dists.join("Release"), &release.stdout).unwrap();
    clearsign(gnupg, &dists);
    std::fs::write(root.join("archive-key.gpg"), key).unwrap();
}

/// Make the stand-in Debian archive the guest's only Debian source, with `main` alone, as a
/// guest's sources often are: `repo_root` is what `build_repo` built, `url` where the guest
/// reaches it.
pub fn debian_archive_source(guest: &Path, repo_root: &Path, url: &str) {
    let keyring = guest.join(ARCHIVE_KEYRING);
    std::fs::create_dir_all(keyring.parent().unwrap()).unwrap();
    std::fs::copy(repo_root.join("archive-key.gpg"), &keyring).unwrap();
    std::fs::write(
        guest.join("etc/apt/sources.list"),
        format!("deb [signed-by=/{ARCHIVE_KEYRING}] {url}/debian bookworm main\n"),
    )
    .unwrap();
}

/// A stand-in `nvidia.ko`: an ELF object whose only content is the `.modinfo` section a real
/// module carries (`version=…`, `license=…`), which is all `modinfo` reads; made with objcopy.
pub fn standin_module(dir: &Path, version: &str) -> Vec<u8> {
    let info = dir.join(format!("modinfo-{version}.bin"));
    std::fs::write(&info, format!("version={version}\0license=Dual MIT/GPL\0name=nvidia\0")).unwrap();
    let ko = dir.join(format!("nvidia-{version}.ko"));
    sh(
        "objcopy",
        &[
            "-I",
            "binary",
            "-O",
            "elf64-x86-64",
            "--rename-section",
            ".data=.modinfo,contents,alloc,load,readonly,data",
            info.to_str().unwrap(),
            ko.to_str().unwrap(),
        ],
    );
    std::fs::read(&ko).unwrap()
}

/// What the server was sent with POST: path, headers (lower-case names), body.
#[derive(Debug, Clone)]
pub struct Post {
    pub path: String,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

pub struct Server {
    pub port: u16,
    pub posts: Arc<Mutex<Vec<Post>>>,
}

/// Serves `dir` on 127.0.0.1 (GET and HEAD; enough HTTP/1.1 for apt, curl and reqwest) and
/// answers every POST with 202, keeping it.
pub fn serve(dir: PathBuf) -> Server {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let posts = Arc::new(Mutex::new(Vec::new()));
    let kept = posts.clone();
    std::thread::spawn(move || {
        for conn in listener.incoming().flatten() {
            let dir = dir.clone();
            let kept = kept.clone();
            std::thread::spawn(move || handle(conn, &dir, &kept));
        }
    });
    Server { port, posts }
}

fn handle(mut conn: std::net::TcpStream, dir: &Path, kept: &Mutex<Vec<Post>>) {
    let _ = conn.set_read_timeout(Some(Duration::from_secs(30)));
    let Ok(clone) = conn.try_clone() else { return };
    let mut reader = BufReader::new(clone);
    let mut first = String::new();
    if reader.read_line(&mut first).is_err() {
        return;
    }
    let mut headers = Vec::new();
    loop {
        let mut l = String::new();
        if reader.read_line(&mut l).map(|n| n == 0).unwrap_or(true) || l == "\r\n" {
            break;
        }
        if let Some((k, v)) = l.split_once(':') {
            headers.push((k.trim().to_ascii_lowercase(), v.trim().to_string()));
        }
    }
    let path = first.split_whitespace().nth(1).unwrap_or("/").to_string();
    if first.starts_with("POST") {
        let len: usize =
            headers.iter().find(|(k, _)| k == "content-length").and_then(|(_, v)| v.parse().ok()).unwrap_or(0);
        let mut body = vec![0u8; len];
        if reader.read_exact(&mut body).is_ok() {
            kept.lock().unwrap().push(Post { path, headers, body });
            let _ = conn.write_all(b"HTTP/1.1 202 Accepted\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
        }
        return;
    }
    // apt percent-encodes what is not plain in a file name (`+` in a version: `%2b`).
    let decoded = percent_decode(&path);
    let rel = decoded.trim_start_matches('/');
    let file = dir.join(rel);
    let head = first.starts_with("HEAD");
    let resp = match (rel.contains(".."), std::fs::read(&file)) {
        (false, Ok(body)) if file.is_file() => {
            let mut r =
                format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n", body.len()).into_bytes();
            if !head {
                r.extend(body);
            }
            r
        }
        _ => b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".to_vec(),
    };
    let _ = conn.write_all(&resp);
}

/// `%XX` escapes in a request path, decoded to bytes (an invalid escape is kept as it is).
fn percent_decode(path: &str) -> String {
    let b = path.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |c: u8| (c as char).to_digit(16);
        match (b[i], b.get(i + 1).copied().and_then(hex), b.get(i + 2).copied().and_then(hex)) {
            (b'%', Some(h), Some(l)) => {
                out.push((h * 16 + l) as u8);
                i += 3;
            }
            (c, _, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}
