//! The control socket's JSON-RPC request handler: any line in gives one
//! well-formed JSON-RPC response line out (or none, for a notification),
//! never a panic. The parser is crates/vdisk-control/src/rpc.rs itself,
//! compiled in here; the handler behind it records nothing and answers as
//! the daemon would for a request it accepts or refuses.
#![no_main]

use libfuzzer_sys::fuzz_target;
use serde_json::{json, Value};

#[path = "../../crates/vdisk-control/src/rpc.rs"]
#[allow(dead_code)]
mod rpc;

/// Refuses changes it cannot carry out (as a read-only peer would be refused), answers reads.
struct Fake;

impl rpc::Handler for Fake {
    fn call(&self, m: rpc::Method) -> Result<Value, rpc::Fault> {
        if m.changes_state() {
            return Err(rpc::Fault::new(-32006, format!("{} refused", m.name())));
        }
        Ok(json!({"method": m.name(), "parsed": format!("{m:?}")}))
    }
}

fuzz_target!(|data: &[u8]| {
    // The socket hands the handler one line at a time, without its newline.
    for line in data.split(|b| *b == b'\n') {
        let Some(out) = rpc::answer(&Fake, line) else { continue };
        assert!(!out.contains('\n'), "a response is one line");
        let v: Value = serde_json::from_str(&out).expect("a response is JSON");
        assert_eq!(v["jsonrpc"], "2.0");
        assert!(v.get("result").is_some() != v.get("error").is_some(), "result or error: {out}");
    }
});
