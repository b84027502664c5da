//! install: plan (pure, from a Snapshot) and apply (journaled, resumable). Lands with the
//! installer issue; `phq-agent install` says so until then.
