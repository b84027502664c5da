//! The plan's own unit tests; the golden plans are tests/install_plans.rs.

use super::*;

/// NCCL's builds differ only in the CUDA release at the end of their version; the newest
/// build of exactly the toolkit's release is the one, whatever is newer for another.
#[test]
fn the_newest_nccl_built_for_exactly_this_cuda() {
    let v = |list: &[&str]| list.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let there = v(&[
        "2.28.3-1+cuda13.0",
        "2.27.3-1+cuda12.9",
        "2.27.5-1+cuda12.90",
        "2.26.5-1+cuda12.9",
        "2.27.3-2+cuda12.9",
        "2.27.10-1+cuda12.8",
        "2.9.9-1+cuda12.9",
        "2.30.0-1",
    ]);
    assert_eq!(newest_for_cuda(&there, "12.9").map(String::as_str), Some("2.27.3-2+cuda12.9"));
    assert_eq!(newest_for_cuda(&there, "12.8").map(String::as_str), Some("2.27.10-1+cuda12.8"));
    assert_eq!(newest_for_cuda(&there, "12.4"), None);
    assert_eq!(newest_for_cuda(&[], "12.9"), None);
    assert_eq!(built_for_cuda("2.27.3-1+cuda12.9"), Some("12.9"));
    assert_eq!(built_for_cuda("2.27.3-1"), None);
    assert_eq!(built_for_cuda("2.27.3-1+cuda"), None);
    assert_eq!(nccl_package(&Distro::Debian12), "libnccl2");
    assert_eq!(nccl_package(&Distro::El9("rocky".into())), "libnccl");
}

#[test]
fn apt_names_index_files_as_it_does() {
    // As found in /var/lib/apt/lists: on Ubuntu guests with NVIDIA's repository, and in the
    // VM test's guest (`10.0.2.100:8080_repo_debian12_x86%5f64_Packages`).
    assert_eq!(
        apt_list_prefix("https://developer.download.nvidia.com/compute/cuda/repos/ubuntu2204/x86_64/"),
        "developer.download.nvidia.com_compute_cuda_repos_ubuntu2204_x86%5f64_"
    );
    assert_eq!(
        apt_list_prefix("http://10.0.2.100:8080/repo/debian12/x86_64/"),
        "10.0.2.100:8080_repo_debian12_x86%5f64_"
    );
}

/// Each step's name is spelt once: `as_str`, serde and `from_name` agree, and the names are the
/// ones journals on disk and the golden plans hold.
#[test]
fn each_step_id_round_trips_its_name() {
    let names: Vec<&str> = StepId::ALL.iter().map(|id| id.as_str()).collect();
    assert_eq!(
        names,
        [
            "repair",
            "repo",
            "components",
            "pin",
            "preflight",
            "headers",
            "kernel-hold",
            "nouveau",
            "driver",
            "mok",
            "persistenced",
            "fabricmanager",
            "fabricmanager-off",
            "toolkit",
            "nccl",
            "hold",
            "reboot",
            "verify",
        ]
    );
    for id in StepId::ALL {
        let json = serde_json::to_string(&id).unwrap();
        assert_eq!(json, format!("\"{id}\""));
        assert_eq!(serde_json::from_str::<StepId>(&json).unwrap(), id);
        assert_eq!(StepId::from_name(id.as_str()), Some(id));
    }
    assert_eq!(StepId::from_name("tookit"), None);
}
