//! What the client commands print: a table or a few lines per reply, or the reply as JSON.

use std::fmt::Write;

use umdev::instance::Params;

use super::table::Table;
use umdev::daemon::protocol::{
    DefinitionsReply, InstanceRow, InstancesReply, RemovedReply, Reply, Request, StartedReply,
    TypesReply,
};

/// The reply as pretty JSON (without the `reply` tag: the command says what it is).
pub fn json(reply: &Reply) -> String {
    let value = match reply {
        Reply::Types(r) => serde_json::to_value(r),
        Reply::Instances(r) => serde_json::to_value(r),
        Reply::Definitions(r) => serde_json::to_value(r),
        Reply::Started(r) => serde_json::to_value(r),
        Reply::Defined(r) => serde_json::to_value(r),
        Reply::Undefined(r) => serde_json::to_value(r),
        Reply::Removed(r) => serde_json::to_value(r),
        Reply::Saved(r) => serde_json::to_value(r),
        Reply::Screenshot(r) => serde_json::to_value(r),
        Reply::Resized(r) => serde_json::to_value(r),
    };
    let value = value.unwrap_or_else(|e| serde_json::json!({ "error": e.to_string() }));
    format!("{value:#}\n")
}

/// The reply for humans.
pub fn human(request: &Request, reply: &Reply, bold: bool) -> String {
    match reply {
        Reply::Types(r) => types(r, bold),
        Reply::Instances(r) => instances(r, bold),
        Reply::Definitions(r) => definitions(r, bold),
        Reply::Started(r) => started(r),
        Reply::Defined(r) => {
            let d = &r.definition;
            let mut s = format!(
                "defined {} ({}/{}, autostart: {}) in {}\n",
                d.uuid,
                d.parent,
                d.type_name,
                yes_no(d.autostart),
                d.path.display()
            );
            if !d.running {
                let _ = writeln!(s, "start it with `umdev start {}`", d.uuid);
            }
            s
        }
        Reply::Undefined(r) => {
            let mut s = format!("undefined {} (deleted {})\n", r.uuid, r.path.display());
            if r.running {
                let _ = writeln!(
                    s,
                    "it keeps running until `umdev stop {}`, and will not be back after a \
                     daemon restart",
                    r.uuid
                );
            }
            s
        }
        Reply::Removed(r) => removed(request, r),
        Reply::Saved(r) => format!(
            "saved the state of {} ({} bytes)\n",
            r.instance.uuid, r.state_len
        ),
        Reply::Screenshot(r) => format!(
            "scanout {} ({}x{}, {} bytes of PNG)\n",
            r.scanout, r.width, r.height, r.png_len
        ),
        Reply::Resized(r) => format!("scanout {} is now {}x{}\n", r.scanout, r.width, r.height),
    }
}

fn yes_no(b: bool) -> &'static str {
    if b {
        "yes"
    } else {
        "no"
    }
}

fn params(p: &Params) -> String {
    if p.is_empty() {
        return "-".into();
    }
    p.iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",")
}

fn types(r: &TypesReply, bold: bool) -> String {
    let mut t = Table::new(&["PARENT", "TYPE", "AVAILABLE", "API", "DESCRIPTION"]);
    for ty in &r.types {
        t.row(vec![
            ty.parent.clone(),
            ty.type_name.clone(),
            ty.available_instances.to_string(),
            ty.device_api.clone(),
            ty.description.clone(),
        ]);
    }
    let mut res = Table::new(&["PARENT", "RESOURCE", "USED", "TOTAL", "UNIT"]);
    for r in &r.resources {
        res.row(vec![
            r.parent.clone(),
            r.resource.clone(),
            r.used.to_string(),
            r.total.to_string(),
            r.unit.clone(),
        ]);
    }
    format!("{}\n{}", t.render(bold), res.render(bold))
}

fn instances(r: &InstancesReply, bold: bool) -> String {
    if r.instances.is_empty() {
        return "no instances running (`umdev create --type T` starts one)\n".into();
    }
    let mut t = Table::new(&["UUID", "TYPE", "CLIENT", "DEFINED", "SOCKET", "PARAMS"]);
    for i in &r.instances {
        t.row(vec![
            i.uuid.clone(),
            format!("{}/{}", i.parent, i.type_name),
            if i.client_attached { "attached" } else { "-" }.into(),
            match (i.defined, i.autostart) {
                (true, true) => "auto",
                (true, false) => "yes",
                (false, _) => "no",
            }
            .into(),
            i.socket.display().to_string(),
            params(&i.params),
        ]);
    }
    t.render(bold)
}

fn definitions(r: &DefinitionsReply, bold: bool) -> String {
    if r.definitions.is_empty() && r.broken.is_empty() {
        return "no definitions (`umdev define --type T` writes one)\n".into();
    }
    let mut t = Table::new(&["UUID", "TYPE", "AUTO", "STATE", "PARAMS"]);
    let mut notes = String::new();
    for d in &r.definitions {
        let state = match (&d.start_error, d.running) {
            (_, true) => "running",
            _ if d.migrating_to.is_some() => {
                let to = d
                    .migrating_to
                    .as_deref()
                    .unwrap_or(std::path::Path::new(""));
                let _ = writeln!(
                    notes,
                    "{}: handed over to {} by `umdev migrate`, not settled: `umdev migrate {} \
                     --to {} --recover` settles it",
                    d.uuid,
                    to.display(),
                    d.uuid,
                    to.display()
                );
                "migrating out"
            }
            (Some(e), false) => {
                let _ = writeln!(notes, "{}: autostart failed: {e}", d.uuid);
                "start failed"
            }
            (None, false) => "stopped",
        };
        t.row(vec![
            d.uuid.clone(),
            format!("{}/{}", d.parent, d.type_name),
            yes_no(d.autostart).into(),
            state.into(),
            params(&d.params),
        ]);
    }
    for b in &r.broken {
        let name = b.uuid.clone().unwrap_or_else(|| {
            b.path
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default()
        });
        t.row(vec![
            name,
            "-".into(),
            "-".into(),
            "broken".into(),
            "-".into(),
        ]);
        let _ = writeln!(notes, "broken definition {}: {}", b.path.display(), b.error);
    }
    let mut s = t.render(bold);
    if !notes.is_empty() {
        s.push('\n');
        s.push_str(&notes);
    }
    s
}

/// The QEMU option that attaches an instance (the socket path as a JSON string).
fn qemu_device(i: &InstanceRow) -> String {
    let path = serde_json::Value::from(i.socket.to_string_lossy().into_owned());
    format!(r#"-device '{{"driver":"vfio-user-pci","socket":{{"type":"unix","path":{path}}}}}'"#)
}

/// `umdev migrate --prepare`: the destination instance a VMM migrates into.
pub fn prepared(r: &StartedReply) -> String {
    let i = &r.instance;
    format!(
        "prepared {} ({}/{}) on {}\nthe VMM connects to it and drives the migration \
         (RESUMING) there; its guest state comes from the source's VMM\n",
        i.uuid,
        i.parent,
        i.type_name,
        i.socket.display()
    )
}

fn started(r: &StartedReply) -> String {
    let i = &r.instance;
    let mut s = format!(
        "started {} ({}/{}) on {}\n",
        i.uuid,
        i.parent,
        i.type_name,
        i.socket.display()
    );
    if let Some(p) = &r.definition {
        let _ = writeln!(s, "defined with autostart in {}", p.display());
    }
    let _ = writeln!(s, "QEMU: {}", qemu_device(i));
    s
}

fn removed(request: &Request, r: &RemovedReply) -> String {
    let verb = match request {
        Request::Stop { .. } => "stopped",
        _ => "removed",
    };
    let mut s = format!("{verb} {}\n", r.uuid);
    if let Some(st) = &r.stopped {
        let waited = st.waited_ms as f64 / 1000.0;
        if st.forced {
            let _ = writeln!(
                s,
                "the client did not release it within {waited:.1} s and was disconnected: \
                 {} pinned pages left, {} pins the device held force-released",
                st.dma.pinned_pages, st.dma.leaked_pins_released
            );
        } else if st.client_was_attached {
            let _ = writeln!(s, "the client released it after {waited:.1} s");
        }
    }
    if let Some(p) = &r.undefined {
        let _ = writeln!(s, "deleted its definition {}", p.display());
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use umdev::daemon::protocol::{DmaRow, InstancesReply};

    #[test]
    fn test_started_prints_the_qemu_device_option_as_json() {
        let row = InstanceRow {
            uuid: "u".into(),
            parent: "gpu".into(),
            type_name: "gpu-4m".into(),
            params: Params::new(),
            socket: "/run/umdev/u.sock".into(),
            client_attached: false,
            defined: false,
            autostart: false,
            dma: DmaRow::default(),
            budget: Default::default(),
        };
        let text = started(&StartedReply {
            instance: row.clone(),
            definition: None,
        });
        assert!(
            text.contains(
                r#"QEMU: -device '{"driver":"vfio-user-pci","socket":{"type":"unix","path":"/run/umdev/u.sock"}}'"#
            ),
            "{text}"
        );
        let list = instances(
            &InstancesReply {
                instances: vec![row],
            },
            false,
        );
        assert_eq!(list.lines().count(), 2);
        assert!(list
            .lines()
            .nth(1)
            .unwrap()
            .starts_with("u     gpu/gpu-4m  -"));
    }
}
