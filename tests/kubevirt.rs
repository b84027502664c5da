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
    // The quoted address ("[::]:9440"): its port follows the last colon.
    let addr = line.split('"').nth(1).unwrap();
    addr.rsplit(':').next().unwrap().parse().unwrap()
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

/// Every document of a multi-document YAML file (separated by `---` lines), as JSON (None: a
/// skip, as `yaml`).
fn yaml_all(rel: &str) -> Option<Vec<Value>> {
    let text = std::fs::read_to_string(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(rel)).unwrap();
    let mut docs = vec![String::new()];
    for line in text.lines() {
        if line.trim_end() == "---" {
            docs.push(String::new());
        } else if let Some(d) = docs.last_mut() {
            d.push_str(line);
            d.push('\n');
        }
    }
    docs.iter().map(|d| common::yaml(d)).filter(|d| d.as_ref().is_none_or(|v| !v.is_null())).collect()
}

/// The CRD's schema as the API server applies it: a structural schema prunes fields it does
/// not declare (Kubernetes docs, "Extend the Kubernetes API with CustomResourceDefinitions",
/// "Field pruning"), so a misspelt field would be dropped without a word. Here it is refused
/// instead: every object that lists its properties gets `additionalProperties: false`.
fn structural(mut s: Value) -> Value {
    fn walk(v: &mut Value) {
        match v {
            Value::Object(m) => {
                if m.contains_key("properties") && !m.contains_key("additionalProperties") {
                    m.insert("additionalProperties".into(), Value::Bool(false));
                }
                m.values_mut().for_each(walk);
            }
            Value::Array(a) => a.iter_mut().for_each(walk),
            _ => {}
        }
    }
    walk(&mut s);
    s
}

/// A tenant's Prometheus (the Prometheus Operator's ServiceMonitor) scrapes the agent: the
/// Service selects the VMs' pods by the label their template sets, on the agent's port; the
/// ServiceMonitor scrapes `/metrics` through it with the bearer token from the Secret; and the
/// ServiceMonitor is valid against the operator's own CRD schema (v0.93.0, vendored under
/// tests/fixtures/crds), which refuses a misspelt field and a wrong type (shown below).
#[test]
fn a_service_monitor_scrapes_the_agent_with_its_token_and_the_operators_schema_accepts_it() {
    let Some(docs) = yaml_all("examples/kubevirt/monitoring.yaml") else { return };
    let Some(crd) = yaml("tests/fixtures/crds/monitoring.coreos.com_servicemonitors.yaml") else { return };
    let kind = |k: &str| docs.iter().find(|d| d["kind"] == k).unwrap_or_else(|| panic!("no {k} in {docs:#?}"));
    let (svc, secret, sm) = (kind("Service"), kind("Secret"), kind("ServiceMonitor"));
    // The Service: the VM template's label, the agent's port, by name.
    let Some(vm) = yaml("examples/kubevirt/vm-h100-1gpu.yaml") else { return };
    let labels = &vm["spec"]["template"]["metadata"]["labels"];
    for (k, v) in svc["spec"]["selector"].as_object().unwrap() {
        assert_eq!(&labels[k], v, "the Service selects {k}={v}, which the VM template must set");
    }
    let port = &svc["spec"]["ports"][0];
    assert_eq!((port["port"].as_u64(), port["targetPort"].as_u64()), (Some(agent_port()), Some(agent_port())));
    // The ServiceMonitor: that Service, that port, the token.
    for (k, v) in sm["spec"]["selector"]["matchLabels"].as_object().unwrap() {
        assert_eq!(&svc["metadata"]["labels"][k], v, "the ServiceMonitor selects the Service by {k}");
    }
    let ep = &sm["spec"]["endpoints"][0];
    assert_eq!((&ep["port"], &ep["path"]), (&port["name"], &Value::from("/metrics")));
    assert_eq!(ep["authorization"]["type"], "Bearer");
    let cred = &ep["authorization"]["credentials"];
    assert_eq!(cred["name"], secret["metadata"]["name"]);
    assert!(secret["stringData"][cred["key"].as_str().unwrap()].is_string(), "{secret}");
    // The operator's schema.
    let version = crd["spec"]["versions"].as_array().unwrap().iter().find(|v| v["name"] == "v1").unwrap();
    assert_eq!(sm["apiVersion"], format!("{}/v1", crd["spec"]["group"].as_str().unwrap()));
    let schema = structural(version["schema"]["openAPIV3Schema"].clone());
    let validator = jsonschema::validator_for(&schema).expect("the CRD's schema compiles");
    let errors: Vec<String> = validator.iter_errors(sm).map(|e| format!("{} at {}", e, e.instance_path())).collect();
    assert!(errors.is_empty(), "the ServiceMonitor against the operator's schema: {errors:#?}");
    // The schema is really applied: a misspelt field and a wrong type are refused.
    let mut typo = sm.clone();
    typo["spec"]["endpoints"][0]["authorisation"] = typo["spec"]["endpoints"][0]["authorization"].take();
    assert!(!validator.is_valid(&typo), "a misspelt field passed");
    let mut wrong = sm.clone();
    wrong["spec"]["endpoints"][0]["interval"] = Value::from(30);
    assert!(!validator.is_valid(&wrong), "an interval that is not a duration string passed");
}

/// The VirtualMachines are valid against KubeVirt's own OpenAPI (the definitions
/// `v1.VirtualMachine` reaches, vendored under tests/fixtures/openapi), with every declared
/// object closed (`structural`) so a misspelt field is refused; and both attach a vsock device
/// (`autoattachVSOCK`, KubeVirt's `VSOCK` feature gate), the platform's channel to the agent.
#[test]
fn virtual_machines_attach_vsock_and_kubevirts_openapi_accepts_them() {
    let text = std::fs::read_to_string(
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/openapi/kubevirt-virtualmachine.json"),
    )
    .unwrap();
    let api: Value = serde_json::from_str(&text).unwrap();
    let schema = structural(serde_json::json!({
        "$ref": "#/definitions/v1.VirtualMachine",
        "definitions": api["definitions"].clone(),
    }));
    let validator = jsonschema::validator_for(&schema).expect("KubeVirt's definitions compile");
    for file in ["examples/kubevirt/vm-h100-1gpu.yaml", "examples/kubevirt/vm-hgx-8gpu-nvswitch.yaml"] {
        let Some(vm) = yaml(file) else { return };
        let errors: Vec<String> =
            validator.iter_errors(&vm).map(|e| format!("{} at {}", e, e.instance_path())).collect();
        assert!(errors.is_empty(), "{file} against KubeVirt's OpenAPI: {errors:#?}");
        assert_eq!(vm["spec"]["template"]["spec"]["domain"]["devices"]["autoattachVSOCK"], true, "{file}");
        // The schema is really applied: a misspelt field and a wrong type are refused.
        let mut typo = vm.clone();
        let devices = &mut typo["spec"]["template"]["spec"]["domain"]["devices"];
        devices["autoAttachVSOCK"] = devices["autoattachVSOCK"].take();
        devices.as_object_mut().unwrap().remove("autoattachVSOCK");
        assert!(!validator.is_valid(&typo), "{file}: a misspelt autoattachVSOCK passed");
        let mut wrong = vm.clone();
        wrong["spec"]["template"]["spec"]["domain"]["devices"]["autoattachVSOCK"] = Value::from("yes");
        assert!(!validator.is_valid(&wrong), "{file}: autoattachVSOCK as a string passed");
    }
}
