//! A real dnf for the EL9 installer test: a Debian 12 root holding Debian's own dnf 4.14 (the
//! dnf RHEL 9 ships), its plugins (config-manager, versionlock) and rpm, dressed as Rocky Linux 9
//! or RHEL 9 (os-release, a release package, a stand-in running kernel in the RPM database), and
//! signed stand-in repositories built here with rpmbuild, rpmsign, createrepo_c and modifyrepo_c:
//!
//! - `rhel9/x86_64/`: NVIDIA's CUDA repository, its driver packages only in the `nvidia-driver`
//!   module's streams as NVIDIA names them (`580-open`, `580-dkms`, `590-open`, `590-dkms`,
//!   `open-dkms`, `latest-dkms`), the fabric manager and NSCQ at the driver's version and a newer
//!   580 one, the CUDA 12.9 toolkit's metas, NCCL's runtime (`libnccl`) built for several CUDA
//!   releases; signed with the NVIDIA stand-in key;
//! - `epel/`: EPEL's key and `epel-release-latest-9.noarch.rpm` (signed with a key standing for
//!   EPEL's), and `epel/9/Everything/x86_64/` with `dkms`, which needs a package only CodeReady
//!   Builder has (EPEL's getting-started instructions enable CRB beside EPEL on RHEL 9 and its
//!   rebuilds because EPEL's packages depend on it; which package does not matter here);
//! - `el9/{baseos,crb,extras}/`: the distribution's repositories (signed with a key standing for
//!   the distribution's): the running kernel's `kernel-devel` and a newer kernel, the dnf plugin
//!   packages, mokutil; CRB's package; Rocky's `epel-release` in extras.
//!
//! Rocky's repository file names CRB `crb` (disabled), as Rocky ships it; RHEL's `redhat.repo`
//! names it `codeready-builder-for-rhel-9-x86_64-rpms` and belongs to a stand-in
//! `subscription-manager` that rewrites it, as the real one does.

use super::debian::{debootstrap_cached, sh, standin_module};
use super::TestKey;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The running kernel the test presents (`uname -r`, /proc/sys/kernel/osrelease).
pub const KERNEL: &str = "5.14.0-427.13.1.el9_4.x86_64";
/// A newer kernel in BaseOS: the version lock must keep it out.
pub const NEWER_KERNEL: (&str, &str) = ("5.14.0", "503.11.1.el9_5");
pub const DRIVER: &str = "580.82.07";
/// The newer branch the pin must keep out, and the one `--replace-driver` switches to.
pub const NEWER_DRIVER: &str = "590.44.01";
/// A newer 580 fabric manager: the exact-version install must not take it.
pub const NEWER_FM: &str = "580.95.05";
/// NVIDIA's driver packages carry epoch 3 on EL (`kmod-nvidia-open-dkms-3:550.90.07-1.el9`).
const NV_EPOCH: &str = "3";

#[derive(Clone, Copy, PartialEq, Debug)]
pub enum Variant {
    Rocky,
    Rhel,
}

impl Variant {
    pub fn id(self) -> &'static str {
        match self {
            Variant::Rocky => "rocky",
            Variant::Rhel => "rhel",
        }
    }
}

/// One stand-in RPM. `arch` None is noarch.
#[derive(Default, Clone)]
pub struct Rpm {
    pub name: String,
    pub epoch: Option<&'static str>,
    pub version: String,
    pub release: String,
    pub arch: Option<&'static str>,
    pub requires: Vec<String>,
    pub provides: Vec<String>,
    pub files: Vec<(String, Vec<u8>)>,
    pub post: String,
}

impl Rpm {
    pub fn new(name: &str, version: &str, release: &str) -> Rpm {
        Rpm { name: name.into(), version: version.into(), release: release.into(), ..Default::default() }
    }
    fn arch(&self) -> &'static str {
        self.arch.unwrap_or("noarch")
    }
    /// `name-epoch:version-release.arch`, as module metadata lists artifacts.
    pub fn nevra(&self) -> String {
        format!("{}-{}:{}-{}.{}", self.name, self.epoch.unwrap_or("0"), self.version, self.release, self.arch())
    }
    pub fn file_name(&self) -> String {
        format!("{}-{}-{}.{}.rpm", self.name, self.version, self.release, self.arch())
    }
}

/// Builds `r` into `out` with rpmbuild (no automatic dependencies: only those written here).
pub fn build_rpm(work: &Path, out: &Path, r: &Rpm) -> PathBuf {
    let top = work.join("rpmbuild");
    let stage = work.join("stage").join(format!("{}-{}-{}", r.name, r.version, r.release));
    std::fs::create_dir_all(&stage).unwrap();
    std::fs::create_dir_all(out).unwrap();
    let mut spec = format!(
        "Name: {}\nVersion: {}\nRelease: {}\nSummary: stand-in for {} (phq-agent install test)\nLicense: MIT\nAutoReqProv: no\n",
        r.name, r.version, r.release, r.name
    );
    if let Some(e) = r.epoch {
        spec.push_str(&format!("Epoch: {e}\n"));
    }
    if r.arch.is_none() {
        spec.push_str("BuildArch: noarch\n");
    }
    for q in &r.requires {
        spec.push_str(&format!("Requires: {q}\n"));
    }
    for p in &r.provides {
        spec.push_str(&format!("Provides: {p}\n"));
    }
    spec.push_str(&format!(
        "%description\nstand-in\n%install\nmkdir -p %{{buildroot}}\ncp -a {}/. %{{buildroot}}/\n%files\n",
        stage.display()
    ));
    for (path, data) in &r.files {
        let f = stage.join(path.trim_start_matches('/'));
        std::fs::create_dir_all(f.parent().unwrap()).unwrap();
        std::fs::write(&f, data).unwrap();
        spec.push_str(&format!("/{}\n", path.trim_start_matches('/')));
    }
    if !r.post.is_empty() {
        spec.push_str(&format!("%post\n{}\n", r.post));
    }
    let spec_file = work.join(format!("{}-{}.spec", r.name, r.version));
    std::fs::write(&spec_file, spec).unwrap();
    let define = |k: &str, v: &str| format!("{k} {v}");
    sh(
        "rpmbuild",
        &[
            "-bb",
            "--quiet",
            "--define",
            &define("_topdir", top.to_str().unwrap()),
            "--define",
            &define("_rpmdir", out.to_str().unwrap()),
            "--define",
            "_build_name_fmt %%{NAME}-%%{VERSION}-%%{RELEASE}.%%{ARCH}.rpm",
            "--define",
            "__os_install_post %{nil}",
            "--define",
            "_build_id_links none",
            "--define",
            "debug_package %{nil}",
            // No build dependencies to check: nothing is compiled.
            "--nodeps",
            spec_file.to_str().unwrap(),
        ],
    );
    let file = out.join(r.file_name());
    assert!(file.is_file(), "rpmbuild made no {}", file.display());
    file
}

/// Signs `rpms` in place with `key` (rpmsign, as a repository's packages are signed).
pub fn sign_rpms(key: &TestKey, rpms: &[PathBuf]) {
    if rpms.is_empty() {
        return;
    }
    let mut args = vec![
        "--addsign".to_string(),
        "--define".into(),
        format!("_gpg_name {}", key.fpr),
        "--define".into(),
        format!("_gpg_path {}", key.home.display()),
        // Debian's rpm names /usr/bin/gpg2, which Debian's gpg package does not carry.
        "--define".into(),
        "__gpg /usr/bin/gpg".into(),
    ];
    args.extend(rpms.iter().map(|p| p.display().to_string()));
    let out = Command::new("rpmsign").args(&args).env("GNUPGHOME", &key.home).output().unwrap();
    assert!(out.status.success(), "rpmsign: {}", String::from_utf8_lossy(&out.stderr));
}

/// The key, armored, as a repository publishes it.
pub fn armored(key: &TestKey) -> String {
    key.gpg(&["--armor", "--export", &key.fpr])
}

/// A module stream of NVIDIA's `nvidia-driver` module (modulemd v2), with its packages.
pub struct Stream<'a> {
    pub name: &'a str,
    pub rpms: Vec<&'a Rpm>,
}

fn modules_yaml(streams: &[Stream]) -> String {
    let mut y = String::new();
    for (i, s) in streams.iter().enumerate() {
        let names: Vec<&str> = {
            let mut v: Vec<&str> = s.rpms.iter().map(|r| r.name.as_str()).collect();
            v.dedup();
            v
        };
        y.push_str(&format!(
            "---\ndocument: modulemd\nversion: 2\ndata:\n  name: nvidia-driver\n  stream: \"{}\"\n  version: {}\n  context: \"00000000\"\n  arch: x86_64\n  summary: Nvidia driver for {} branch\n  description: >-\n    stand-in (phq-agent install test)\n  license:\n    module:\n    - MIT\n  profiles:\n    default:\n      rpms:\n",
            s.name,
            20250101000000u64 + i as u64,
            s.name
        ));
        for n in &names {
            y.push_str(&format!("      - {n}\n"));
        }
        y.push_str("  artifacts:\n    rpms:\n");
        for r in &s.rpms {
            y.push_str(&format!("    - {}\n", r.nevra()));
        }
        y.push_str("...\n");
    }
    // Each stream's default profile, as NVIDIA's repository names them (its guides install
    // `nvidia-driver:<stream>` with no profile named); no default stream: none is enabled until
    // asked for.
    y.push_str("---\ndocument: modulemd-defaults\nversion: 1\ndata:\n  module: nvidia-driver\n  profiles:\n");
    for s in streams {
        y.push_str(&format!("    \"{}\": [default]\n", s.name));
    }
    y.push_str("...\n");
    y
}

/// createrepo_c over `dir` (its .rpm files), then the module streams with modifyrepo_c.
pub fn make_repo(dir: &Path, streams: &[Stream]) {
    sh("createrepo_c", &["-q", "--no-database", dir.to_str().unwrap()]);
    if !streams.is_empty() {
        let yaml = dir.join("modules.yaml");
        std::fs::write(&yaml, modules_yaml(streams)).unwrap();
        sh("modifyrepo_c", &["--mdtype=modules", yaml.to_str().unwrap(), dir.join("repodata").to_str().unwrap()]);
    }
}

/// A copy of the repository `from` at `to` with every package signed by `key` instead, its
/// index and module streams made again (the packages' checksums change with their signatures).
pub fn resign_repo(from: &Path, to: &Path, key: &TestKey) {
    std::fs::create_dir_all(to).unwrap();
    let mut rpms = Vec::new();
    for e in std::fs::read_dir(from).unwrap().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.ends_with(".rpm") || name == "modules.yaml" || name.ends_with(".pub") {
            std::fs::copy(e.path(), to.join(&name)).unwrap();
            if name.ends_with(".rpm") {
                rpms.push(to.join(&name));
            }
        }
    }
    let mut delsign = vec!["--delsign".to_string()];
    delsign.extend(rpms.iter().map(|p| p.display().to_string()));
    let args: Vec<&str> = delsign.iter().map(String::as_str).collect();
    sh("rpmsign", &args);
    sign_rpms(key, &rpms);
    sh("createrepo_c", &["-q", "--no-database", to.to_str().unwrap()]);
    if to.join("modules.yaml").is_file() {
        sh(
            "modifyrepo_c",
            &["--mdtype=modules", to.join("modules.yaml").to_str().unwrap(), to.join("repodata").to_str().unwrap()],
        );
    }
}

/// What `build_repos` made: the keys' fingerprints and the packages the root starts with.
pub struct Repos {
    pub nvidia_fpr: String,
    pub epel_fpr: String,
    pub distro_key: String,
    /// The root's own packages (release, kernel), installed into its RPM database.
    pub base: Vec<PathBuf>,
    /// The whole tree served over HTTP.
    pub dir: PathBuf,
}

fn unit(desc: &str) -> Vec<u8> {
    format!("[Unit]\nDescription={desc}\n[Service]\nExecStart=/bin/true\n[Install]\nWantedBy=multi-user.target\n")
        .into_bytes()
}

/// Where the stand-in DKMS build leaves its marker while it runs (the kill lands then).
pub const DKMS_MARKER: &str = "tmp/phq-dkms-building";

/// Builds every repository under `root` (served at `url`).
pub fn build_repos(root: &Path, url: &str) -> Repos {
    let work = root.join("work");
    std::fs::create_dir_all(&work).unwrap();
    let keydir = |n: &str| {
        let d = work.join(n);
        std::fs::create_dir_all(&d).unwrap();
        TestKey::new(&d)
    };
    let nvidia = keydir("nvidia-key");
    let epel = keydir("epel-key");
    let distro = keydir("distro-key");
    let dir = root.join("www");
    let (nv, epel_root, baseos, crb, extras) = (
        dir.join("rhel9/x86_64"),
        dir.join("epel"),
        dir.join("el9/baseos"),
        dir.join("el9/crb"),
        dir.join("el9/extras"),
    );
    let epel_repo = epel_root.join("9/Everything/x86_64");
    let build = |out: &Path, r: &Rpm| build_rpm(&work, out, r);

    // --- NVIDIA: the driver's packages in module streams, per branch and flavour.
    let nv_pkg = |name: &str, version: &str, requires: Vec<String>, files: Vec<(String, Vec<u8>)>, post: &str| Rpm {
        epoch: Some(NV_EPOCH),
        requires,
        files,
        post: post.into(),
        arch: Some("x86_64"),
        ..Rpm::new(name, version, "1.el9")
    };
    let dkms_post = format!(
        "touch /{DKMS_MARKER}; sleep 2; mkdir -p /lib/modules/{KERNEL}/extra; cp /usr/src/nvidia-open/nvidia.ko /lib/modules/{KERNEL}/extra/nvidia.ko; depmod {KERNEL}; rm -f /{DKMS_MARKER}"
    );
    let branch = |v: &str| -> Vec<Rpm> {
        let module = standin_module(&work, v);
        vec![
            nv_pkg(
                "kmod-nvidia-open-dkms",
                v,
                vec!["dkms".into()],
                vec![("usr/src/nvidia-open/nvidia.ko".into(), module.clone())],
                &dkms_post,
            ),
            nv_pkg("kmod-nvidia-latest-dkms", v, vec!["dkms".into()], vec![], ""),
            nv_pkg(
                "nvidia-persistenced",
                v,
                vec![],
                vec![("usr/lib/systemd/system/nvidia-persistenced.service".into(), unit("NVIDIA Persistence Daemon"))],
                "",
            ),
            nv_pkg("nvidia-driver-cuda", v, vec![format!("nvidia-persistenced = {NV_EPOCH}:{v}")], vec![], ""),
            Rpm {
                files: vec![(
                    "usr/lib/systemd/system/nvidia-fabricmanager.service".into(),
                    unit("NVIDIA fabric manager"),
                )],
                arch: Some("x86_64"),
                ..Rpm::new("nvidia-fabricmanager", v, "1")
            },
            Rpm { arch: Some("x86_64"), ..Rpm::new("libnvidia-nscq", v, "1") },
        ]
    };
    let b580 = branch(DRIVER);
    let b590 = branch(NEWER_DRIVER);
    let fm_newer = vec![
        Rpm {
            files: vec![("usr/lib/systemd/system/nvidia-fabricmanager.service".into(), unit("NVIDIA fabric manager"))],
            arch: Some("x86_64"),
            ..Rpm::new("nvidia-fabricmanager", NEWER_FM, "1")
        },
        Rpm { arch: Some("x86_64"), ..Rpm::new("libnvidia-nscq", NEWER_FM, "1") },
    ];
    // The toolkit's meta and two of the metas it pulls in, as NVIDIA's repository has them.
    let toolkit = vec![
        Rpm {
            files: vec![(
                "usr/local/cuda-12.9/version.json".into(),
                br#"{"cuda":{"name":"CUDA SDK","version":"12.9.1"}}"#.to_vec(),
            )],
            requires: vec!["cuda-compiler-12-9 >= 12.9.1".into(), "cuda-libraries-12-9 >= 12.9.1".into()],
            arch: Some("x86_64"),
            ..Rpm::new("cuda-toolkit-12-9", "12.9.1", "1")
        },
        Rpm { arch: Some("x86_64"), ..Rpm::new("cuda-compiler-12-9", "12.9.1", "1") },
        Rpm { arch: Some("x86_64"), ..Rpm::new("cuda-libraries-12-9", "12.9.1", "1") },
    ];
    // NCCL's runtime, outside the module streams as in NVIDIA's repository: one build per CUDA
    // release, the CUDA release in the release field (`libnccl-2.27.3-1+cuda12.9`).
    let nccl: Vec<Rpm> = super::debian::NCCL_BUILDS
        .iter()
        .map(|b| {
            let (version, release) = b.split_once('-').unwrap();
            Rpm { arch: Some("x86_64"), ..Rpm::new("libnccl", version, release) }
        })
        .collect();
    let mut signed = Vec::new();
    for r in b580.iter().chain(&b590).chain(&fm_newer).chain(&toolkit).chain(&nccl) {
        signed.push(build(&nv, r));
    }
    sign_rpms(&nvidia, &signed);
    // The open streams carry the open module; the `-dkms` ones the proprietary. Fabric
    // manager and NSCQ ride in each branch's streams (NVIDIA's `fm` profile).
    fn refs(b: &[Rpm], open: bool) -> Vec<&Rpm> {
        let other = if open { "kmod-nvidia-latest-dkms" } else { "kmod-nvidia-open-dkms" };
        b.iter().filter(|r| r.name != other).collect()
    }
    let mut s580 = refs(&b580, true);
    s580.extend(fm_newer.iter());
    let streams = vec![
        Stream { name: "580-open", rpms: s580 },
        Stream { name: "580-dkms", rpms: refs(&b580, false) },
        Stream { name: "590-open", rpms: refs(&b590, true) },
        Stream { name: "590-dkms", rpms: refs(&b590, false) },
        Stream { name: "open-dkms", rpms: refs(&b590, true) },
        Stream { name: "latest-dkms", rpms: refs(&b590, false) },
    ];
    make_repo(&nv, &streams);
    std::fs::write(nv.join("D42D0685.pub"), armored(&nvidia)).unwrap();

    // --- EPEL: its key, its release package (by URL for RHEL), dkms.
    let epel_key_text = armored(&epel);
    let epel_repo_file = format!(
        "[epel]\nname=Extra Packages for Enterprise Linux 9 - $basearch\nbaseurl={url}/epel/9/Everything/x86_64/\nenabled=1\ngpgcheck=1\ngpgkey=file:///etc/pki/rpm-gpg/RPM-GPG-KEY-EPEL-9\n"
    );
    let epel_release = Rpm {
        files: vec![
            ("etc/yum.repos.d/epel.repo".into(), epel_repo_file.into_bytes()),
            ("etc/pki/rpm-gpg/RPM-GPG-KEY-EPEL-9".into(), epel_key_text.clone().into_bytes()),
        ],
        ..Rpm::new("epel-release", "9", "8.el9")
    };
    let dkms = Rpm { requires: vec!["phq-crb-only".into()], ..Rpm::new("dkms", "3.1.5", "1.el9") };
    let e1 = build(&epel_root.join("stage"), &epel_release);
    let e2 = build(&epel_repo, &dkms);
    sign_rpms(&epel, &[e1.clone(), e2]);
    std::fs::rename(&e1, epel_root.join("epel-release-latest-9.noarch.rpm")).unwrap();
    std::fs::remove_dir_all(epel_root.join("stage")).unwrap();
    make_repo(&epel_repo, &[]);
    std::fs::write(epel_root.join("RPM-GPG-KEY-EPEL-9"), &epel_key_text).unwrap();

    // --- The distribution's repositories.
    let (kv, kr) = KERNEL.trim_end_matches(".x86_64").split_once('-').unwrap();
    // RHEL's kernel.spec gives kernel, kernel-core and kernel-devel `installonlypkg(kernel)`:
    // dnf installs a newer one beside the running one instead of replacing it.
    let installonly = || vec!["installonlypkg(kernel)".to_string()];
    let devel = |v: &str, r: &str| Rpm {
        arch: Some("x86_64"),
        provides: installonly(),
        files: vec![(format!("usr/src/kernels/{v}-{r}.x86_64/Makefile"), b"# stand-in\n".to_vec())],
        ..Rpm::new("kernel-devel", v, r)
    };
    let core = |v: &str, r: &str| {
        let k = format!("{v}-{r}.x86_64");
        Rpm {
            arch: Some("x86_64"),
            provides: installonly(),
            files: vec![
                (format!("boot/vmlinuz-{k}"), b"stand-in\n".to_vec()),
                (format!("lib/modules/{k}/modules.builtin"), Vec::new()),
                (format!("lib/modules/{k}/modules.order"), Vec::new()),
            ],
            // RHEL's kernel-core owns /lib/modules/<k>/build, a link to kernel-devel's tree.
            post: format!("ln -sfn /usr/src/kernels/{k} /lib/modules/{k}/build"),
            ..Rpm::new("kernel-core", v, r)
        }
    };
    let kmeta = |v: &str, r: &str| Rpm {
        arch: Some("x86_64"),
        provides: installonly(),
        requires: vec![format!("kernel-core = {v}-{r}")],
        ..Rpm::new("kernel", v, r)
    };
    let (nkv, nkr) = NEWER_KERNEL;
    let mut distro_rpms = vec![
        build(&baseos, &devel(kv, kr)),
        build(&baseos, &devel(nkv, nkr)),
        build(&baseos, &core(nkv, nkr)),
        build(&baseos, &kmeta(nkv, nkr)),
        build(&baseos, &Rpm { arch: Some("x86_64"), ..Rpm::new("kernel-headers", kv, kr) }),
        build(&baseos, &Rpm::new("dnf-plugins-core", "4.3.0", "13.el9")),
        build(&baseos, &Rpm::new("python3-dnf-plugin-versionlock", "4.3.0", "13.el9")),
        build(&baseos, &Rpm { arch: Some("x86_64"), ..Rpm::new("mokutil", "0.6.0", "4.el9") }),
        build(&crb, &Rpm::new("phq-crb-only", "1.0", "1.el9")),
    ];
    // Rocky carries epel-release in its own extras, signed with its own key.
    distro_rpms.push(build(&extras, &epel_release));
    let release = |v: Variant| Rpm {
        provides: vec!["system-release".into(), "system-release(releasever) = 9".into()],
        ..Rpm::new(if v == Variant::Rocky { "rocky-release" } else { "redhat-release" }, "9.4", "1.el9")
    };
    // The root's own packages, in its RPM database from the start: the running kernel, the
    // release package dnf reads $releasever from, and what Debian's own files stand for (the
    // shell the scriptlets run with).
    let base_dir = root.join("base");
    let mut base = vec![
        build(&base_dir, &core(kv, kr)),
        build(&base_dir, &kmeta(kv, kr)),
        build(&base_dir, &release(Variant::Rocky)),
        build(&base_dir, &release(Variant::Rhel)),
        build(&base_dir, &Rpm { provides: vec!["/bin/sh".into()], ..Rpm::new("phq-debian-base", "12", "1") }),
    ];
    sign_rpms(&distro, &distro_rpms);
    sign_rpms(&distro, &base);
    for d in [&baseos, &crb, &extras] {
        make_repo(d, &[]);
    }
    base.sort();
    Repos { nvidia_fpr: nvidia.fpr, epel_fpr: epel.fpr, distro_key: armored(&distro), base, dir }
}

/// The cached Debian root with dnf, its plugins, rpm, kmod (modinfo, depmod) and systemd.
pub fn base_root() -> PathBuf {
    debootstrap_cached("bookworm-el9")
}
