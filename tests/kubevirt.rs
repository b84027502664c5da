//! The KubeVirt examples say what the issue and the operator guide promise: GPUs by
//! `gpus[].deviceName`, the NVSwitches as `hostDevices`, cloud-init from a Secret, a readiness
//! probe on the agent's `/healthz` at the port the packaged config listens on, and a
//! NetworkPolicy that opens that port to the poller and Prometheus only, and nothing else less
//! than before. YAML is read with the system Python's yaml module (cloud-init brings it).

mod common;

use serde_json::Value;
use std::path::PathBuf;

/// The YAML file (relative to the repository) as JSON, or None (a skip) without
/// /usr/bin/python3 and its yaml module.
fn yaml(rel: &str) -> Option<Value> {
    common::yaml(&std::fs::read_to_string(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(rel)).unwrap())
}

fn agent_port() -> u64 {
    let cfg = std::fs::read_to_string(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("packaging/config.toml")).unwrap();
    let line = cfg.lines().find(|l| l.starts_with("listen = ")).unwrap();
    line.split(':').nth(1).unwrap().trim_end_matches(|c: char| !c.is_ascii_digit()).parse().unwrap()
}

#[test]
fn virtual_machines_pass_gpus_and_probe_the_agent() {
    for (file, gpus, switches) in
        [("examples/kubevirt/vm-h100-1gpu.yaml", 1, 0), ("examples/kubevirt/vm-hgx-8gpu-nvswitch.yaml", 8, 4)]
    {
        let Some(vm) = yaml(file) else { return };
        assert_eq!(vm["kind"], "VirtualMachine", "{file}");
        let spec = &vm["spec"]["template"]["spec"];
        let devices = &spec["domain"]["devices"];
        assert_eq!(devices["gpus"].as_array().unwrap().len(), gpus, "{file}");
        assert!(devices["gpus"]
            .as_array()
            .unwrap()
            .iter()
            .all(|g| g["deviceName"].as_str().unwrap().starts_with("nvidia.com/")));
        let hd = devices["hostDevices"].as_array().map(Vec::len).unwrap_or(0);
        assert_eq!(hd, switches, "{file}");
        let probe = &spec["readinessProbe"]["httpGet"];
        assert_eq!(probe["path"], "/healthz", "{file}");
        assert_eq!(probe["port"].as_u64(), Some(agent_port()), "{file}");
        let ci = spec["volumes"].as_array().unwrap().iter().find(|v| v.get("cloudInitNoCloud").is_some()).unwrap();
        assert!(ci["cloudInitNoCloud"]["secretRef"]["name"].is_string(), "{file}");
        assert_eq!(vm["spec"]["template"]["metadata"]["labels"]["phoeniqs.ch/phq-agent"], "true");
    }
}

#[test]
fn network_policy_opens_the_agent_port_to_two_peers_only() {
    let Some(np) = yaml("examples/kubevirt/networkpolicy.yaml") else { return };
    assert_eq!(np["kind"], "NetworkPolicy");
    assert_eq!(np["spec"]["podSelector"]["matchLabels"]["phoeniqs.ch/phq-agent"], "true");
    let port = agent_port();
    let rules = np["spec"]["ingress"].as_array().unwrap();
    let covers = |p: &Value, proto: &str, n: u64| {
        p["protocol"] == proto
            && p["port"].as_u64().is_some_and(|lo| lo <= n && n <= p["endPort"].as_u64().unwrap_or(lo))
    };
    // Exactly one rule opens the agent's port: to the poller and to Prometheus.
    let opening: Vec<&Value> =
        rules.iter().filter(|r| r["ports"].as_array().unwrap().iter().any(|p| covers(p, "TCP", port))).collect();
    assert_eq!(opening.len(), 1, "one ingress rule must open TCP {port}: {rules:#?}");
    let peers: Vec<String> = opening[0]["from"]
        .as_array()
        .expect("the rule for the agent's port names its peers")
        .iter()
        .map(|peer| {
            // Both selectors in one peer: these pods of that namespace, not a whole namespace
            // or a label any tenant could put on a pod of its own.
            for selector in ["namespaceSelector", "podSelector"] {
                let labels = &peer[selector]["matchLabels"];
                assert!(labels.as_object().is_some_and(|m| !m.is_empty()), "{selector} in peer {peer}");
            }
            peer.to_string()
        })
        .collect();
    assert_eq!(peers.len(), 2, "{peers:?}");
    for r in rules {
        let ports = r["ports"].as_array().unwrap();
        if ports.iter().any(|p| covers(p, "TCP", port)) {
            // The rule that opens the agent's port names its peers, and opens nothing else.
            assert_eq!(r["from"].as_array().unwrap().len(), 2);
            assert_eq!(ports.len(), 1);
        } else {
            assert!(r.get("from").is_none(), "other ports stay open to all");
        }
    }
    // Every other TCP port, and UDP, stays reachable as before the policy.
    for n in [22, 80, 443, port - 1, port + 1, 65535] {
        assert!(
            rules
                .iter()
                .any(|r| r.get("from").is_none() && r["ports"].as_array().unwrap().iter().any(|p| covers(p, "TCP", n))),
            "TCP {n}"
        );
    }
    assert!(rules.iter().any(|r| r["ports"].as_array().unwrap().iter().any(|p| covers(p, "UDP", 53))));
}
