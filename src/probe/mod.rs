//! probe: CUDA measurements (cudarc, loaded at run time) and their judgement against per-SKU
//! floors. Lands with the probes issue; `phq-agent probe` says so until then.
