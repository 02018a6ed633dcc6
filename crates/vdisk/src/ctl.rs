//! `vdisk ctl`: the control socket's client. One JSON-RPC request per
//! command, the answer as a table (or `--json`). Exit 0 when done, 1 when the
//! server refuses (its message on stderr) or cannot be reached, 2 on a usage
//! error.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};

use clap::ValueEnum;
use serde_json::{json, Map, Value};
use vdisk_daemon::Error;

use crate::cli::{CtlArgs, CtlCommand, QosArgs};
use crate::ctl_verbs::{absolute, flag, set};

pub fn run(a: CtlArgs) -> Result<(), Error> {
    let control =
        a.control.clone().or_else(|| std::env::var_os("VDISK_CONTROL").map(PathBuf::from)).ok_or_else(|| {
            Error::invalid(
                "which server? give --control PATH (as given to `vdisk serve --control`) or set VDISK_CONTROL",
            )
        })?;
    // A mirror that does not pivot by itself is followed until it is ready.
    let (wait, until_ready) = match &a.command {
        CtlCommand::Stream { job, .. } | CtlCommand::Commit { job, .. } => (job.wait, false),
        CtlCommand::Mirror { job, pivot, .. } => (job.wait, !pivot),
        _ => (false, false),
    };
    let (method, params) = request(a.command)?;
    let method_name = method;
    let result = call(&control, method, params)?;
    if wait {
        let id =
            result["job"].as_u64().ok_or_else(|| Error::failed(format!("the server's answer has no job: {result}")))?;
        if !a.json {
            eprintln!(
                "vdisk: {} of export {} started as job {id}",
                result["type"].as_str().unwrap_or("job"),
                result["name"]
            );
        }
        return vdisk_control::follow::wait(|| call(&control, "job_list", Map::new()), id, a.json, until_ready);
    }
    let text = if a.json {
        serde_json::to_string_pretty(&result).unwrap_or_default() + "\n"
    } else {
        vdisk_control::text::human_output(method_name, &result)
    };
    // A reader that went away (`| head`) is not an error of ours.
    let _ = std::io::stdout().write_all(text.as_bytes());
    Ok(())
}

fn qos_params(q: QosArgs, into: &mut Map<String, Value>) {
    for (k, v) in [("iops", q.iops), ("bps", q.bps), ("read_bps", q.read_bps), ("write_bps", q.write_bps)] {
        if let Some(v) = v {
            into.insert(k.into(), v.into());
        }
    }
}

/// The JSON-RPC method and params for a command.
fn request(c: CtlCommand) -> Result<(&'static str, Map<String, Value>), Error> {
    let mut p = Map::new();
    let method = match c {
        CtlCommand::Add { image, name, readonly, format, backing, fuse, vhost_user_blk, num_queues, qos } => {
            p.insert("image".into(), json!(absolute(&image)?));
            // The wire spells a format as the command line does.
            let format = format.to_possible_value().expect("every format has a name");
            p.insert("format".into(), format.get_name().into());
            // Paths made absolute for the server; an rbd:POOL/IMAGE name is no path.
            let abs = |o: Option<PathBuf>| {
                o.map(|p| if vdisk_image::rbd::is_rbd(&p) { p } else { std::path::absolute(&p).unwrap_or(p) })
            };
            let opts = [("name", name.map(Value::from)), ("fuse", abs(fuse).map(|p| json!(p)))];
            let more = [
                ("vhost_user_blk", abs(vhost_user_blk).map(|p| json!(p))),
                ("backing", abs(backing.backing).map(|p| json!(p))),
                ("ceph_conf", abs(backing.ceph.ceph_conf).map(|p| json!(p))),
                ("ceph_id", backing.ceph.ceph_id.map(Value::from)),
                ("num_queues", num_queues.map(Value::from)),
            ];
            let flags = [("readonly", flag(readonly)), ("ignore_backing_mtime", flag(backing.ignore_backing_mtime))];
            set(&mut p, opts.into_iter().chain(more).chain(flags));
            qos_params(qos, &mut p);
            "export_add"
        }
        CtlCommand::Remove { name, hard } => {
            p.insert("name".into(), name.into());
            p.insert("hard".into(), hard.into());
            "export_remove"
        }
        CtlCommand::List => "export_list",
        CtlCommand::Stats { name } => {
            set(&mut p, [("name", name.map(Into::into))]);
            "export_stats"
        }
        CtlCommand::Qos { name, qos } => {
            p.insert("name".into(), name.into());
            qos_params(qos, &mut p);
            if p.len() == 1 {
                return Err(Error::invalid(
                    "qos: give at least one of --iops, --bps, --read-bps, --write-bps (0 lifts)",
                ));
            }
            "export_set_qos"
        }
        CtlCommand::Info => "server_info",
        CtlCommand::Reload => "config_reload",
        CtlCommand::Bitmap(b) => {
            let (method, params) = crate::ctl_verbs::bitmap_request(b);
            p = params;
            method
        }
        CtlCommand::Snapshot { name, overlay, rbd_snap, format } => {
            let overlay = overlay.map(|o| absolute(&o).map(|o| json!(o))).transpose()?;
            let format = overlay.is_some().then(|| format.to_possible_value().expect("named").get_name().into());
            let snap = rbd_snap.map(Into::into);
            set(&mut p, [("name", Some(name.into())), ("overlay", overlay), ("rbd_snap", snap), ("format", format)]);
            "export_snapshot"
        }
        CtlCommand::Stream { name, job } => {
            set(&mut p, [("name", Some(name.into())), ("bps", job.bps.map(Into::into))]);
            "export_stream"
        }
        CtlCommand::Commit { name, top, base, delete, active, job } => {
            let [top, base] = [top, base].map(|l| l.map(|l| absolute(&l).map(|l| json!(l))).transpose());
            let given = [("name", Some(name.into())), ("top", top?), ("base", base?), ("delete", flag(delete))];
            set(&mut p, given.into_iter().chain([("active", flag(active)), ("bps", job.bps.map(Into::into))]));
            "export_commit"
        }
        CtlCommand::Jobs => "job_list",
        CtlCommand::Cancel { job } => {
            p.insert("id".into(), job.into());
            "job_cancel"
        }
        CtlCommand::Pivot { job } => {
            p.insert("id".into(), job.into());
            "job_pivot"
        }
        CtlCommand::Mirror { name, to, format, pivot, existing, job } => {
            let to = absolute(Path::new(&to))?.display().to_string();
            let format = format.to_possible_value().expect("every format has a name");
            let given =
                [("name", Some(name.into())), ("to", Some(to.into())), ("format", Some(format.get_name().into()))];
            set(
                &mut p,
                given.into_iter().chain([
                    ("pivot", flag(pivot)),
                    ("existing", flag(existing)),
                    ("bps", job.bps.map(Into::into)),
                ]),
            );
            "export_mirror"
        }
        CtlCommand::Backup(b) => {
            let (method, params) = crate::ctl_verbs::backup_request(b)?;
            p = params;
            method
        }
    };
    Ok((method, p))
}

/// Sends one request and returns its result; a JSON-RPC error is a runtime failure (exit 1).
fn call(control: &std::path::Path, method: &str, params: Map<String, Value>) -> Result<Value, Error> {
    let unreachable = |e: std::io::Error| {
        Error::failed(format!(
            "cannot talk to the server at {}: {e} (is `vdisk serve --control {}` running?)",
            control.display(),
            control.display()
        ))
    };
    let mut stream = UnixStream::connect(control).map_err(|e| {
        if e.kind() == std::io::ErrorKind::PermissionDenied {
            Error::failed(format!(
                "cannot talk to the server at {}: {e}: the control socket's mode and group (--control-mode, \
                 --control-group) do not let this user connect",
                control.display()
            ))
        } else {
            unreachable(e)
        }
    })?;
    let req = json!({"jsonrpc": "2.0", "id": 1, "method": method, "params": params});
    writeln!(stream, "{req}").map_err(unreachable)?;
    let mut line = String::new();
    BufReader::new(&stream).read_line(&mut line).map_err(unreachable)?;
    let resp: Value = serde_json::from_str(&line)
        .map_err(|e| Error::failed(format!("the server's answer is not JSON ({e}): {line:?}")))?;
    if let Some(err) = resp.get("error") {
        return Err(Error::failed(err["message"].as_str().unwrap_or("the server refused").to_owned()));
    }
    Ok(resp.get("result").cloned().unwrap_or(Value::Null))
}
