#!/usr/bin/env python3
"""Writes the fake-NVML scenarios (format v1, docs/fake-nvml-scenario.md) and the fake-CUDA ones
(cuda-*.json, docs/fake-cuda-scenario.md) in this folder.

The 8-GPU scenarios match the fixture sysroot tests/fixtures/sysroots/hgx-8gpu-healthy (GPUs on
buses 09..10, NVSwitches on 11..14); the single-GPU one matches h100-pcie-single. Values follow
an idle HGX H100 as NVML reports it. Rerun after editing:  python3 examples/scenarios/make-scenarios.py
"""
import copy
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
BUSES = [0x09, 0x0A, 0x0B, 0x0C, 0x0D, 0x0E, 0x0F, 0x10]
# The driver every NVML scenario reports: an R580 release (NVIDIA's long-term support branch in
# December 2026), whose CUDA driver API is 13.0 and whose NVML version carries that major.
DRIVER = {"driver_version": "580.82.07", "nvml_version": "13.580.82.07", "cuda_driver_version": 13000}
CUDA_DRIVER_API = DRIVER["cuda_driver_version"]
SWITCH_BUSES = [0x11, 0x12, 0x13, 0x14]


def h100(i, bus):
    return {
        "name": "NVIDIA H100 80GB HBM3",
        "uuid": f"GPU-3f1c0b7e-{i:04x}-4000-8000-0000000000{bus:02x}",
        "serial": f"16501234567{80 + i}",
        # nvmlDeviceGetModuleId: one id per module on the baseboard (0 only off a baseboard);
        # which number each slot carries is the board's, 1-8 here is the scenario's choice.
        "module_id": i + 1,
        # nvmlDeviceGetViolationStatus, ns since the driver loaded: an idle board held back by
        # low utilisation most of the time, a little power capping, nothing else.
        "violations_ns": {"power": 2_000_000_000, "thermal": 0, "sync_boost": 0, "board_limit": 0,
                          "low_utilization": 3_000_000_000_000, "reliability": 0,
                          "total_app_clocks": 2_000_000_000, "total_base_clocks": 0},
        "board_part_number": "692-2G520-0200-000",
        "vbios_version": "96.00.74.00.0D",
        "inforom_image_version": "G520.0200.00.05",
        "inforom_valid": True,
        "pci": {"bus_id": f"00000000:{bus:02X}:00.0", "pci_device_id": "0x233010DE", "pci_subsystem_id": "0x16C110DE"},
        # v2 memory info: the reservation is apart from "used" (about 900 MB, as measured on an
        # A100 in nvml-wrapper issue #57; the fake answers free = total - reserved - used).
        "memory": {"total_bytes": 85520809984, "used_bytes": 8388608, "reserved_bytes": 947912704},
        "bar1": {"total_bytes": 137438953472, "used_bytes": 2097152},
        "temperature_c": 31 + i,
        "slowdown_temperature_c": 87,
        "shutdown_temperature_c": 92,
        "power_usage_mw": 71000 + 1000 * i,
        "power_limit_mw": 700000,
        "default_power_limit_mw": 700000,
        "clocks_mhz": {"sm": 345, "mem": 2619},
        "throttle_reasons": ["gpu_idle"],
        "ecc": {"current": True, "pending": True, "volatile": {"corrected": 0, "uncorrected": 0}, "aggregate": {"corrected": 0, "uncorrected": 0},
                # By location (nvmlDeviceGetMemoryErrorCounter): on-die SRAM and the HBM apart;
                # the totals above are their sums.
                "sram": {"volatile": {"corrected": 0, "uncorrected": 0}, "aggregate": {"corrected": 0, "uncorrected": 0}},
                "dram": {"volatile": {"corrected": 0, "uncorrected": 0}, "aggregate": {"corrected": 0, "uncorrected": 0}}},
        "remapped_rows": {"correctable": 0, "uncorrectable": 0, "pending": False, "failure": False},
        "persistence_mode": True,
        "mig": {"current": False, "pending": False},
        "pcie": {"gen_current": 5, "gen_max": 5, "width_current": 16, "width_max": 16, "replay_counter": 0},
        # 18 NVLinks to the board's four NVSwitches (at buses 0x11-0x14 in the fixtures; which link
        # goes to which switch is this fixture's choice, not a documented wiring).
        "nvlinks": [{"active": True, "crc_flit_errors": 0, "crc_data_errors": 0, "replay_errors": 0, "recovery_errors": 0,
                     "tx_kib": 1048576 * (link + 1), "rx_kib": 524288 * (link + 1),
                     "remote_pci": f"00000000:{SWITCH_BUSES[link % 4]:02X}:00.0"} for link in range(18)],
        # nvmlDeviceGetP2PStatus(NVLINK): every GPU of the board reaches every other over NVLink.
        "nvlink_p2p": "ok",
        "fabric": {"state": "completed", "status": "NVML_SUCCESS", "cluster_uuid": "8f7c1b2a-3d4e-4f50-8a6b-7c8d9e0f1a2b", "clique_id": 1},
        "processes": [],
        "utilization": {"gpu": 0, "memory": 0},
        "memory_temperature_c": 35 + i,
        # An hour at the idle draw above, in millijoules.
        "energy_mj": (71000 + 1000 * i) * 3600,
        # H100 has video decoders and no encoders; both idle.
        "encoder_utilization": 0,
        "decoder_utilization": 0,
        # GPM (Hopper): metric ids of nvmlGpmMetricId_t, percentages and MiB/s; a GPU under a
        # light load. The last GPU reports its FP16 pipe as NaN (left out by the agent, never 0).
        "gpm": {"metrics": {
            "1": 12.5 + i, "2": 10.0, "3": 8.0, "5": 5.0 + i, "10": 7.5,
            "11": 0.0, "12": 3.0, "13": None if i == 7 else 1.0,
            "20": 12.0, "21": 48.0, "60": 100.0, "61": 200.0,
        }},
    }


def hgx():
    return {
        "init_error": None,
        **DRIVER,
        "devices": [h100(i, b) for i, b in enumerate(BUSES)],
    }


def healthy():
    return hgx()


def fabric_not_started():
    s = hgx()
    for d in s["devices"]:
        d["fabric"] = {"state": "not_started", "status": "NVML_SUCCESS", "cluster_uuid": "00000000-0000-0000-0000-000000000000", "clique_id": 0}
        for l in d["nvlinks"]:
            l["active"] = False
        # Without a fabric the GPUs have no NVLink path to each other.
        d["nvlink_p2p"] = "not_supported"
    return s


def xid79():
    """GPU 0000:0c:00.0 fell off the bus: Xid 79 arrives, then every query of it fails."""
    s = hgx()
    d = s["devices"][3]
    d["xid_events"] = [{"xid": 79, "after_ms": 0}]
    lost = "NVML_ERROR_GPU_IS_LOST"
    for fn in ["nvmlDeviceGetTemperature", "nvmlDeviceGetPowerUsage", "nvmlDeviceGetEccMode", "nvmlDeviceGetTotalEccErrors",
               "nvmlDeviceGetRemappedRows", "nvmlDeviceGetCurrentClocksThrottleReasons", "nvmlDeviceGetCurrPcieLinkWidth",
               "nvmlDeviceGetNvLinkState", "nvmlDeviceGetGpuFabricInfo", "nvmlDeviceGetMemoryInfo_v2", "nvmlDeviceGetMigMode",
               "nvmlDeviceGetPersistenceMode", "nvmlDeviceGetPcieReplayCounter", "nvmlDeviceGetEnforcedPowerLimit",
               "nvmlDeviceValidateInforom", "nvmlDeviceGetFieldValues", "nvmlDeviceGetTotalEnergyConsumption",
               "nvmlDeviceGetEncoderUtilization", "nvmlDeviceGetDecoderUtilization"]:
        d.setdefault("errors", {})[fn] = lost
    return s


def xid79_init_hangs():
    """The Xid 79 machine while the driver is still in recovery: nvmlInit_v2 blocks for the first
    20 s (nvidia-smi hanging for minutes is what operators meet first with Xid 79 and 119:
    NVIDIA/open-gpu-kernel-modules issue #446; the fake's `hang` cites the sources)."""
    s = xid79()
    s["hangs"] = [{"function": "nvmlInit_v2", "until_ms": 20000}]
    return s


def memory_query_hangs():
    """Healthy, but GPU 0000:0c:00.0's memory query never returns (its GSP stopped answering):
    the other seven GPUs must still be read."""
    s = hgx()
    s["hangs"] = [{"function": "nvmlDeviceGetMemoryInfo_v2", "gpu": 3}]
    return s


def ecc_dbe():
    """Double-bit ECC on GPU 0000:0b:00.0 with the row remap still pending."""
    s = hgx()
    d = s["devices"][2]
    d["ecc"]["volatile"] = {"corrected": 3, "uncorrected": 2}
    d["ecc"]["aggregate"] = {"corrected": 17, "uncorrected": 2}
    # All of them in the HBM: a double-bit error in a row, remapped at the next reset.
    d["ecc"]["dram"] = {"volatile": d["ecc"]["volatile"], "aggregate": d["ecc"]["aggregate"]}
    d["remapped_rows"] = {"correctable": 0, "uncorrectable": 1, "pending": True, "failure": False}
    d["xid_events"] = [{"xid": 48, "after_ms": 0}, {"xid": 63, "after_ms": 0}]
    return s


def xid154_reset_required():
    """GPU 0000:0d:00.0 halted its micro-controller (Xid 62), and the driver changed its recovery
    action to "GPU reset required" (Xid 154; NVML field 230 reads 1 from then on)."""
    s = hgx()
    d = s["devices"][4]
    d["xid_events"] = [{"xid": 62, "after_ms": 0}, {"xid": 154, "after_ms": 0}]
    d["recovery_action"] = 1
    return s


def pcie_thermal():
    """GPU 0000:0e:00.0 under load on a Gen3 x8 link, held down by HW thermal slowdown."""
    s = hgx()
    d = s["devices"][5]
    d["pcie"].update({"gen_current": 3, "width_current": 8, "replay_counter": 12})
    d["throttle_reasons"] = ["hw_thermal_slowdown", "sw_power_cap"]
    # Held back by heat for 300 s of its life so far (and by its power cap for 900 s).
    d["violations_ns"].update({"thermal": 300_000_000_000, "power": 900_000_000_000, "total_app_clocks": 1_200_000_000_000})
    d["temperature_c"] = 89
    d["utilization"] = {"gpu": 97, "memory": 61}
    d["clocks_mhz"] = {"sm": 990, "mem": 2619}
    d["processes"] = [{"pid": 48211, "used_bytes": 40 << 30}]
    return s


def nvlink_down():
    """Two inactive NVLinks (4 and 11) on GPU 0000:0a:00.0; link 4 had recovery errors first."""
    s = hgx()
    d = s["devices"][1]
    d["nvlinks"][4].update({"active": False, "recovery_errors": 3, "replay_errors": 41})
    d["nvlinks"][11]["active"] = False
    return s


def vm_unsupported():
    """One H100 PCIe in a VM whose NVML answers little: most calls NOT_SUPPORTED."""
    d = {
        "name": "NVIDIA H100 PCIe",
        "uuid": "GPU-5b1e2c3d-0000-4000-8000-0000000000aa",
        "pci": {"bus_id": "00000000:09:00.0", "pci_device_id": "0x233110DE"},
        "memory": {"total_bytes": 85520809984, "used_bytes": 0},
        "temperature_c": 38,
        "persistence_mode": True,
        "unsupported": ["nvmlDeviceGetPowerUsage", "nvmlDeviceGetEnforcedPowerLimit", "nvmlDeviceGetSerial"],
    }
    return {**DRIVER, "devices": [d]}


def h200_vm():
    """One H200 SXM of an HGX H200 node passed through to a VM, healthy, no NVLink peers in it."""
    d = {
        "name": "NVIDIA H200",
        "uuid": "GPU-7c2d4e6f-0000-4000-8000-0000000000b2",
        "pci": {"bus_id": "00000000:09:00.0", "pci_device_id": "0x233510DE"},
        "memory": {"total_bytes": 150754820096, "used_bytes": 0},
        "temperature_c": 36,
        "persistence_mode": True,
        # The fifth module of its node's baseboard (the scenario's choice of number).
        "module_id": 5,
        # Idle, as NVML tells it (no compute process, no utilisation): a re-check may run.
        "processes": [],
        "utilization": {"gpu": 0, "memory": 0},
    }
    return {**DRIVER, "devices": [d]}


def h200_vm_agent_context():
    """The H200 VM while the agent itself holds a context on the GPU: NVML lists the agent."""
    s = h200_vm()
    s["devices"][0]["processes"] = [{"caller": True, "used_bytes": 536870912}]
    return s


def h200_vm_ecc_rising():
    """The H200 VM correcting ECC errors while it is used: each read of its volatile corrected
    count finds 2 more (the scenario's fault). No uncorrectable error, no row remapped."""
    s = h200_vm()
    s["devices"][0]["ecc"] = {
        "current": True,
        "pending": True,
        "volatile": {"corrected": 0, "uncorrected": 0},
        "aggregate": {"corrected": 0, "uncorrected": 0},
        "corrected_per_read": 2,
    }
    return s


def hgx_nvlink_p2p_off():
    """NVML says GPUs 0000:0b:00.0 and 0000:0f:00.0 reach no GPU over NVLink (P2P status not
    supported), though their links report active: their peer copies go over PCIe."""
    s = hgx()
    for i in (2, 6):
        s["devices"][i]["nvlink_p2p"] = "not_supported"
    return s


def hgx_mixed_vbios():
    """GPU 0000:0e:00.0 runs another VBIOS than the seven others of its baseboard: the trace of
    a part swapped without the board's firmware (Azure's health checks fail such a node,
    azure_gpu_vbios.nhc, NHC2001). Everything else is healthy."""
    s = hgx()
    s["devices"][5]["vbios_version"] = "96.00.89.00.01"
    return s


def hgx_sram_uncorrectable():
    """GPU 0000:0c:00.0 has had one uncorrectable error in its on-die SRAM over its life (none
    since the last reset) and corrects a few in its HBM: row remapping cannot heal the SRAM, so
    Azure's health checks fail such a GPU (azure_gpu_ecc.nhc, NHC2019) though the totals look
    like an old, healed error."""
    s = hgx()
    e = s["devices"][3]["ecc"]
    e["sram"]["aggregate"] = {"corrected": 4, "uncorrected": 1}
    e["dram"]["volatile"] = {"corrected": 6, "uncorrected": 0}
    e["dram"]["aggregate"] = {"corrected": 40, "uncorrected": 0}
    e["volatile"] = {"corrected": 6, "uncorrected": 0}
    e["aggregate"] = {"corrected": 44, "uncorrected": 1}
    return s


# The links an H100 NVL / H100 PCIe bridge leaves unwired, as NVML listed them inactive on Azure's
# NC H100 v5 (azurehpc-health-checks#162 names 4, 5, 10, 11, 16, ...; 17 for the sixth is this
# scenario's choice): 12 of the 18 links run over the bridges (facts::NVLINKS_PER_BRIDGED_H100).
NVL_UNWIRED = {4, 5, 10, 11, 16, 17}
NVL_BUSES = [0x09, 0x0A]


def h100_nvl(i, bus, peer):
    return {
        "name": "NVIDIA H100 NVL",
        "uuid": f"GPU-9d3e5f70-{i:04x}-4000-8000-0000000000{bus:02x}",
        "pci": {"bus_id": f"00000000:{bus:02X}:00.0", "pci_device_id": "0x232110DE"},
        # 94 GB of HBM3 (NVIDIA's H100 NVL); the byte count is the scenario's choice.
        "memory": {"total_bytes": 100485038080, "used_bytes": 0},
        "temperature_c": 34 + i,
        "persistence_mode": True,
        # A card, not a baseboard module: NVML's module id is 0 off a baseboard.
        "module_id": 0,
        "processes": [],
        "utilization": {"gpu": 0, "memory": 0},
        # Each wired link runs to the bridged peer (nvmlDeviceGetNvLinkRemotePciInfo_v2 names it);
        # an unwired one answers no remote end.
        "nvlinks": [{"active": link not in NVL_UNWIRED, **({} if link in NVL_UNWIRED else {"remote_pci": f"00000000:{peer:02X}:00.0"})}
                    for link in range(18)],
        "nvlink_p2p": "ok",
    }


def h100_nvl_pair():
    """Two H100 NVL cards joined by their NVLink bridges, as Azure's NC80adis H100 v5 gives them:
    12 of the 18 links NVML lists active on each, the rest unwired by design."""
    a, b = NVL_BUSES
    return {**DRIVER, "devices": [h100_nvl(0, a, b), h100_nvl(1, b, a)]}


def h100_nvl_pair_link_down():
    """The bridged pair with link 7 of GPU 0000:0a:00.0 down: 11 of its 12 wired links active."""
    s = h100_nvl_pair()
    s["devices"][1]["nvlinks"][7] = {"active": False}
    return s


def h100_nvl_pair_links_absent():
    """The bridged pair after a start where no link trained (Azure/azhpc-images#443: 29 of 50
    starts, `nvidia-smi topo -m` showing SYS between the two GPUs): every link inactive on both,
    and NVML reports no NVLink path between them."""
    s = h100_nvl_pair()
    for d in s["devices"]:
        d["nvlinks"] = [{"active": False} for _ in range(18)]
        d["nvlink_p2p"] = "not_supported"
    return s


def init_error(code):
    return {"init_error": code}


SCENARIOS = {
    "hgx-8gpu-healthy": healthy,
    "hgx-8gpu-fabric-not-started": fabric_not_started,
    "hgx-8gpu-xid79": xid79,
    "hgx-8gpu-xid79-init-hangs": xid79_init_hangs,
    "hgx-8gpu-memory-query-hangs": memory_query_hangs,
    "hgx-8gpu-ecc-dbe-remap-pending": ecc_dbe,
    "hgx-8gpu-xid154-reset-required": xid154_reset_required,
    "hgx-8gpu-pcie-degraded-thermal": pcie_thermal,
    "hgx-8gpu-nvlink-down": nvlink_down,
    "hgx-8gpu-nvlink-p2p-off": hgx_nvlink_p2p_off,
    "hgx-8gpu-mixed-vbios": hgx_mixed_vbios,
    "hgx-8gpu-sram-uncorrectable": hgx_sram_uncorrectable,
    "h100-pcie-vm-unsupported": vm_unsupported,
    "h100-nvl-pair": h100_nvl_pair,
    "h100-nvl-pair-link-down": h100_nvl_pair_link_down,
    "h100-nvl-pair-links-absent": h100_nvl_pair_links_absent,
    "h200-vm": h200_vm,
    "h200-vm-agent-context": h200_vm_agent_context,
    "h200-vm-ecc-rising": h200_vm_ecc_rising,
    "init-driver-not-loaded": lambda: init_error("NVML_ERROR_DRIVER_NOT_LOADED"),
    "init-version-mismatch": lambda: init_error("NVML_ERROR_LIB_RM_VERSION_MISMATCH"),
    "init-no-permission": lambda: init_error("NVML_ERROR_NO_PERMISSION"),
}


# ---------------------------------------------------------------------------------------------
# fake-cuda scenarios (docs/fake-cuda-scenario.md): the same machines as CUDA sees them. Rates
# are typical figures, not floors: host<->device ~55 GB/s pinned over PCIe Gen5 x16 (52-57 GB/s
# measured in H100 VMs, nvbandwidth issue #6 and Azure's H100 health checks); HBM traffic of a
# device copy, read + write, 2540 GB/s on H100 SXM and 3110 GB/s on H200 (DCGM's measured
# figures behind its 0.75x floors, diag-skus.yaml.in); GPU<->GPU over NVSwitch 375 GB/s per
# direction (Azure's floor is 335). CUDA's default device order is an unspecified heuristic
# ("FASTEST_FIRST", CUDA programming guide, environment variables): the 8-GPU scenario ranks
# each pair of GPUs the other way round, so a tool that forgets CUDA_DEVICE_ORDER=PCI_BUS_ID
# numbers its GPUs unlike nvidia-smi.
# ---------------------------------------------------------------------------------------------

def cuda_gpu(name, bus, rank, memory, h2d, hbm, sgemm):
    return {"name": name, "pci_bus_id": f"0000:{bus:02x}:00.0", "memory_bytes": memory, "fastest_first_rank": rank,
            "h2d_gbps": h2d, "d2h_gbps": h2d, "hbm_gbps": hbm, "sgemm_tflops": sgemm}


def cuda_hgx():
    """NCCL's all-reduce by NVLink SHARP at 480 GB/s bus bandwidth: our choice, a little above
    Azure's floor for 8 H100s (460 GB/s, azurehpc-health-checks nd96isr_h100_v5.conf), which
    sits under what healthy machines reach; with NVLS off the rings run at the links' 375, below
    that floor, as rings on NVLink 4 are (the floor presumes NVLS)."""
    gpus = [cuda_gpu("NVIDIA H100 80GB HBM3", b, i ^ 1, 85520809984, 55.0, 2540.0, 51.0) for i, b in enumerate(BUSES)]
    return {"driver_version": CUDA_DRIVER_API, "devices": gpus,
            "peers": {"access": True, "gbps": 375.0, "nvlink": True, "pairs": []},
            "nccl": {"nvls_busbw_gbps": 480.0}}


def cuda_hgx_ecc():
    """GPU 3 (0000:0c:00.0) meets an uncorrectable ECC error on its third memset."""
    s = cuda_hgx()
    s["devices"][3]["faults"] = [{"on": "memset", "after": 2, "error": "CUDA_ERROR_ECC_UNCORRECTABLE"}]
    return s


def cuda_hgx_exclusive():
    """GPU 5 (0000:0e:00.0) in exclusive-process mode with another process's context on it."""
    s = cuda_hgx()
    s["devices"][5].update({"compute_mode": "exclusive_process", "other_process": True})
    return s


def cuda_hgx_slow_pair():
    """The NVLink path from GPU 2 to GPU 6 runs at 120 GB/s (a degraded link)."""
    s = cuda_hgx()
    s["peers"]["pairs"] = [{"src": 2, "dst": 6, "gbps": 120.0}]
    return s


def cuda_hgx_pcie_pair():
    """GPUs 2 and 6 have no NVLink path: their peer copies, to and from every GPU, run at a
    PCIe rate (55 GB/s). NVML's side of the same machine is hgx-8gpu-nvlink-p2p-off."""
    s = cuda_hgx()
    s["peers"]["pairs"] = [{"src": a, "dst": b, "gbps": 55.0, "nvlink": False}
                           for a in range(8) for b in range(8) if a != b and (a in (2, 6) or b in (2, 6))]
    return s


def cuda_hgx_no_peer_pair():
    """GPUs 2 and 6, joined by NVLink through the NVSwitches, report no peer access to each other
    (cuDeviceCanAccessPeer answers 0 both ways; NVML's P2P status likewise). NCCL refuses to
    start on it ("P2P is disabled between NVLINK connected GPUs", NCCL's src/graph/paths.cc);
    with NCCL_IGNORE_DISABLED_P2P=1 its SHM transport carries the pair through host memory."""
    s = cuda_hgx()
    s["peers"]["pairs"] = [{"src": 2, "dst": 6, "access": False}, {"src": 6, "dst": 2, "access": False}]
    return s


def cuda_hgx_p2p_lost():
    """GPUs 2 and 6 without NVLink between them (55 GB/s over PCIe, behind one PCIe switch) report
    peer access, but writes through it never land: PCIe ACS sending P2P traffic to an IOMMU that
    drops it (NCCL's troubleshooting guide, "PCI Access Control Services"; NVIDIA/nccl#2079 and
    #257). Peer copies between them leave their destination unchanged, and NCCL's rings through
    the pair wait for ever."""
    s = cuda_hgx()
    s["peers"]["pairs"] = [{"src": a, "dst": b, "gbps": 55.0, "nvlink": False, "lost": True} for a, b in ((2, 6), (6, 2))]
    return s


def cuda_hgx_gen3x8():
    """GPU 5 (0000:0e:00.0) on a link trained down to PCIe Gen3 x8: 8 GT/s x 8 lanes with
    128b/130b coding is 7.9 GB/s raw (PCIe Base Specification); the 6.6 GB/s copy rate is this
    scenario's choice, about the share of raw that the healthy scenarios' 55 of 63 GB/s is."""
    s = cuda_hgx()
    s["devices"][5].update({"h2d_gbps": 6.6, "d2h_gbps": 6.6})
    return s


def cuda_h100_pcie():
    return {"driver_version": CUDA_DRIVER_API, "devices": [cuda_gpu("NVIDIA H100 PCIe", 0x09, 0, 85520809984, 55.0, 1640.0, 30.0)]}


def cuda_h100_pcie_stuck_bit():
    """The H100 PCIe with bit 3 of the word one GiB into its memory stuck at 1."""
    s = cuda_h100_pcie()
    s["devices"][0]["stuck_bits"] = [{"offset": 1 << 30, "bit": 3, "value": 1}]
    return s


def cuda_h100_pcie_stuck_at_the_ends():
    """The H100 PCIe with a stuck bit at each end of what the standard level's memory test covers
    (its first word, 0x1_0660_0000 bytes in, past the copy probes' buffers and the eviction
    buffer; and its last word): bit 0 of the first stuck at 1, bit 0 of the last stuck at 0. Each
    sits where a pass ends writing, so the next pass, starting there, reads it from the L2 unless
    the L2 was evicted between them."""
    s = cuda_h100_pcie()
    s["devices"][0]["stuck_bits"] = [
        {"offset": 0x1_0660_0000, "bit": 0, "value": 1},
        {"offset": 0x12_CFA0_0000 - 8, "bit": 0, "value": 0},
    ]
    return s


def cuda_h100_pcie_coupled_bit():
    """The H100 PCIe with two shorted cells (16 GiB in: past the buffers the copy probes allocate
    first, inside what the memory test covers). Near: bit 6 of the word 16 GiB + 64 bytes in reads
    bit 6 of its neighbour 64 bytes below. Far: bit 26 of the word 16 GiB + 64 MiB + 128 bytes in
    (bit 2 of its byte 3) reads the same bit of the word 64 MiB below it. Solid patterns give
    both cells of a pair the same value and cannot see either; the address patterns give them
    different bits (the addresses differ by 0x40 and by 2^26) and see both. Moving inversions see
    only the far one, and only walking up: the check kernel's threads take one word each per
    round of their grid-stride loop, so a neighbour 64 bytes away is loaded in the same round as
    the victim, before either is rewritten; a cell 64 MiB below was rewritten rounds before."""
    s = cuda_h100_pcie()
    far = (16 << 30) + (64 << 20) + 128
    s["devices"][0]["coupled_bits"] = [
        {"offset": (16 << 30) + 64, "bit": 6, "aggressor": 16 << 30},
        {"offset": far + 3, "bit": 2, "aggressor": far - (64 << 20) + 3},
    ]
    return s


def cuda_h200():
    return {"driver_version": CUDA_DRIVER_API, "devices": [cuda_gpu("NVIDIA H200", 0x09, 0, 150754820096, 55.0, 3110.0, 55.0)]}


def cuda_h200_slow_sm_copy():
    """The H200 whose SMs reach HBM at 1800 GB/s (below DCGM's 2333 floor) while its copy
    engines still copy at 3110: the scenario's own figures, a GPU whose kernels are held back."""
    s = cuda_h200()
    s["devices"][0]["sm_copy_gbps"] = 1800.0
    return s


def cuda_h200_slower_h2d():
    """The same H200 a while later, its host->device copies 12% slower (48.4 GB/s, still above
    the 48 GB/s floor): what its baseline is there to notice."""
    s = cuda_h200()
    s["devices"][0]["h2d_gbps"] = 48.4
    return s


def cuda_h200_wrong_gemm_entry():
    """The H200 computing one entry of every GEMM product wrong, C[4000, 17] one too large (a
    faulty SM): an entry the old 1,024-entry spot check never sampled."""
    s = cuda_h200()
    s["devices"][0]["gemm_wrong_entries"] = [[4000, 17]]
    return s


def cuda_h200_memtest_hangs():
    """The H200 whose memory test's first kernel never finishes (docs/fake-cuda-scenario.md,
    `hang`): every synchronisation after its launch blocks."""
    s = cuda_h200()
    s["hang"] = {"kernel": "phq_mem_write"}
    return s


def cuda_h200_old_driver():
    """The H200 under a driver of CUDA 10.2, older than the probe kernels' PTX ISA 7.0 (which
    needs CUDA 11.0): the driver refuses the module, and the probes that need no kernel still run."""
    s = cuda_h200()
    s["driver_version"] = 10020
    return s


def cuda_hgx_toolkit_too_new():
    """The HGX whose driver supports CUDA 12.8 under a toolkit built for 12.9: its cuBLAS 12.9.1
    and NCCL both carry a CUDA 12.9 runtime, which refuses the older driver, so cublasCreate
    answers CUBLAS_STATUS_NOT_INITIALIZED and ncclCommInitAll fails (docs/fake-cuda-scenario.md).
    Nothing is wrong with the GPUs."""
    s = cuda_hgx()
    s["driver_version"] = 12080
    s["cublas"] = {"version": "12.9.1", "needs_driver_version": 12090}
    s["nccl"]["needs_driver_version"] = 12090
    return s


def cuda_h100_nvl_pair():
    """The bridged H100 NVL pair (NVML's h100-nvl-pair): peer copies at 257 GB/s, what healthy NC
    H100 v5 pairs measure (azurehpc-health-checks#162: 256.63 GB/s each way). HBM and SGEMM are
    the scenario's choice, DCGM's H100 NVL floors (2043 GB/s, 25.6 TFLOP/s) over its 0.75."""
    gpus = [cuda_gpu("NVIDIA H100 NVL", b, i, 100485038080, 55.0, 2724.0, 34.1) for i, b in enumerate(NVL_BUSES)]
    return {"driver_version": CUDA_DRIVER_API, "devices": gpus,
            "peers": {"access": True, "gbps": 257.0, "nvlink": True, "pairs": []}}


def cuda_h100_nvl_pair_slow():
    """The bridged pair copying at 171 GB/s, the share of 8 of its 12 links (257 x 8 / 12): below
    the bridged floor of 223 GB/s."""
    s = cuda_h100_nvl_pair()
    s["peers"]["gbps"] = 171.0
    return s


CUDA_SCENARIOS = {
    "cuda-h100-nvl-pair": cuda_h100_nvl_pair,
    "cuda-h100-nvl-pair-slow": cuda_h100_nvl_pair_slow,
    "cuda-hgx-8gpu": cuda_hgx,
    "cuda-hgx-8gpu-ecc": cuda_hgx_ecc,
    "cuda-hgx-8gpu-exclusive": cuda_hgx_exclusive,
    "cuda-hgx-8gpu-slow-pair": cuda_hgx_slow_pair,
    "cuda-hgx-8gpu-pcie-pair": cuda_hgx_pcie_pair,
    "cuda-hgx-8gpu-no-peer-pair": cuda_hgx_no_peer_pair,
    "cuda-hgx-8gpu-p2p-lost": cuda_hgx_p2p_lost,
    "cuda-hgx-8gpu-gen3x8": cuda_hgx_gen3x8,
    "cuda-hgx-8gpu-toolkit-too-new": cuda_hgx_toolkit_too_new,
    "cuda-h100-pcie": cuda_h100_pcie,
    "cuda-h100-pcie-stuck-bit": cuda_h100_pcie_stuck_bit,
    "cuda-h100-pcie-stuck-at-the-ends": cuda_h100_pcie_stuck_at_the_ends,
    "cuda-h100-pcie-coupled-bit": cuda_h100_pcie_coupled_bit,
    "cuda-h200": cuda_h200,
    "cuda-h200-slow-sm-copy": cuda_h200_slow_sm_copy,
    "cuda-h200-slower-h2d": cuda_h200_slower_h2d,
    "cuda-h200-wrong-gemm-entry": cuda_h200_wrong_gemm_entry,
    "cuda-h200-old-driver": cuda_h200_old_driver,
    "cuda-h200-memtest-hangs": cuda_h200_memtest_hangs,
    "cuda-init-not-ready": lambda: {"init_error": "CUDA_ERROR_SYSTEM_NOT_READY", "devices": []},
}


def main():
    for name, fn in CUDA_SCENARIOS.items():
        with open(os.path.join(HERE, name + ".json"), "w") as f:
            json.dump(fn(), f, indent=2)
            f.write("\n")
    for name, fn in SCENARIOS.items():
        s = fn()
        for d in s.get("devices", []):
            d.setdefault("xid_events", [])
            d.setdefault("unsupported", [])
            d.setdefault("errors", {})
        with open(os.path.join(HERE, name + ".json"), "w") as f:
            json.dump(s, f, indent=2)
            f.write("\n")
    print(f"wrote {len(SCENARIOS) + len(CUDA_SCENARIOS)} scenarios under {HERE}")


if __name__ == "__main__":
    main()
