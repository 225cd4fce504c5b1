//! How results reach people and programs: tables or JSON on stdout; nothing
//! else goes to stdout, so `-o json` output can always be piped.

use std::io::Write;

use comfy_table::{presets, ContentArrangement, Table};
use serde::Serialize;
use time::OffsetDateTime;

use crate::cli::Format;

/// Prints `value` as pretty JSON.
pub fn json<T: Serialize + ?Sized>(value: &T) -> anyhow::Result<()> {
    println!("{}", serde_json::to_string_pretty(value)?);
    Ok(())
}

/// Prints `value` as YAML: the same fields as `-o json`, block style.
pub fn yaml<T: Serialize + ?Sized>(value: &T) -> anyhow::Result<()> {
    print!("{}", to_yaml(&serde_json::to_value(value)?));
    Ok(())
}

/// Prints `value` as the data format asked for (`-o json` or `-o yaml`).
pub fn data<T: Serialize + ?Sized>(format: Format, value: &T) -> anyhow::Result<()> {
    match format {
        Format::Yaml => yaml(value),
        _ => json(value),
    }
}

/// `value` as a YAML document (block style, ending in a newline). Strings
/// are plain where YAML reads them back as the same string, else
/// double-quoted with JSON's escapes (which YAML's double quotes accept).
pub fn to_yaml(value: &serde_json::Value) -> String {
    let mut out = String::new();
    yaml_block(value, 0, &mut out);
    if !out.ends_with('\n') {
        out.push('\n');
    }
    out
}

fn yaml_block(value: &serde_json::Value, indent: usize, out: &mut String) {
    use serde_json::Value;
    let pad = " ".repeat(indent);
    match value {
        Value::Object(map) if !map.is_empty() => {
            for (i, (k, v)) in map.iter().enumerate() {
                // The first key of a list item follows its "- ".
                if i > 0 || !out.ends_with("- ") {
                    out.push_str(&pad);
                }
                out.push_str(&yaml_scalar_str(k));
                out.push(':');
                yaml_child(v, indent + 2, out);
            }
        }
        Value::Array(items) if !items.is_empty() => {
            for (i, item) in items.iter().enumerate() {
                if i > 0 || !out.ends_with("- ") {
                    out.push_str(&pad);
                }
                out.push_str("- ");
                match item {
                    Value::Object(m) if !m.is_empty() => yaml_block(item, indent + 2, out),
                    Value::Array(a) if !a.is_empty() => yaml_block(item, indent + 2, out),
                    _ => {
                        out.push_str(&yaml_scalar(item));
                        out.push('\n');
                    }
                }
            }
        }
        _ => {
            out.push_str(&pad);
            out.push_str(&yaml_scalar(value));
            out.push('\n');
        }
    }
}

/// A mapping's value: on the key's line when a scalar (or empty), else
/// below it, indented.
fn yaml_child(value: &serde_json::Value, indent: usize, out: &mut String) {
    use serde_json::Value;
    match value {
        Value::Object(m) if !m.is_empty() => {
            out.push('\n');
            yaml_block(value, indent, out);
        }
        Value::Array(a) if !a.is_empty() => {
            out.push('\n');
            // A list under a key sits at the key's own indentation, as
            // kubectl prints it.
            yaml_block(value, indent - 2, out);
        }
        _ => {
            out.push(' ');
            out.push_str(&yaml_scalar(value));
            out.push('\n');
        }
    }
}

fn yaml_scalar(value: &serde_json::Value) -> String {
    use serde_json::Value;
    match value {
        Value::Null => "null".into(),
        Value::Bool(b) => b.to_string(),
        Value::Number(n) => n.to_string(),
        Value::String(s) => yaml_scalar_str(s),
        Value::Array(_) => "[]".into(),
        Value::Object(_) => "{}".into(),
    }
}

/// A string as YAML reads it back: plain when that is unambiguous.
fn yaml_scalar_str(s: &str) -> String {
    let reserved = [
        "", "~", "null", "Null", "NULL", "true", "True", "TRUE", "false", "False", "FALSE", "yes", "Yes",
        "YES", "no", "No", "NO", "on", "On", "ON", "off", "Off", "OFF", "y", "Y", "n", "N",
    ];
    let first = s.chars().next().unwrap_or(' ');
    let plain = !reserved.contains(&s)
        && s.parse::<f64>().is_err()
        && !s.starts_with(|c: char| c.is_ascii_digit() && s.contains(':'))
        && !"-?:,[]{}#&*!|>'\"%@`. ".contains(first)
        && !s.ends_with(' ')
        && !s.contains(": ")
        && !s.contains(" #")
        && s.chars().all(|c| !c.is_control());
    if plain {
        s.to_string()
    } else {
        serde_json::Value::String(s.to_string()).to_string()
    }
}

/// Reports a change: the object as JSON, or one line for people.
pub fn done<T: Serialize>(format: Format, value: &T, line: &str) -> anyhow::Result<()> {
    match format {
        Format::Json | Format::Yaml => data(format, value),
        Format::Table | Format::Wide => {
            println!("{line}");
            Ok(())
        }
    }
}

/// What `-o json` prints for a deletion: `{"deleted":{"kind":"vm","name":"web01"}}`.
#[derive(Debug, Serialize)]
pub struct Deleted<'a> {
    pub deleted: Object<'a>,
}

/// One object by kind and name.
#[derive(Debug, Serialize)]
pub struct Object<'a> {
    /// `vm`, `network`, `token`, ...
    pub kind: &'a str,
    pub name: &'a str,
}

/// Reports a deletion: [`Deleted`] as JSON, or `kind/name deleted` for people.
pub fn deleted(format: Format, kind: &str, name: &str) -> anyhow::Result<()> {
    let value = Deleted {
        deleted: Object { kind, name },
    };
    done(format, &value, &format!("{kind}/{name} deleted"))
}

/// Writes one line to stdout and flushes it (a pipe sees it at once);
/// false once the reader has gone (`| head`), which ends a watch quietly.
pub fn line(text: &str) -> anyhow::Result<bool> {
    let mut out = std::io::stdout().lock();
    match writeln!(out, "{text}").and_then(|_| out.flush()) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// Prints rows under headers, kubectl style: no borders, aligned columns.
pub fn table(headers: &[&str], rows: Vec<Vec<String>>) {
    let mut t = Table::new();
    t.load_preset(presets::NOTHING)
        .set_content_arrangement(ContentArrangement::Disabled)
        .set_header(headers.iter().map(|h| h.to_string()));
    for row in rows {
        t.add_row(row);
    }
    for line in t.to_string().lines() {
        println!("{}", line.trim_end().strip_prefix(' ').unwrap_or(line.trim_end()));
    }
}

/// Prints key/value lines for one object.
pub fn fields(rows: &[(&str, String)]) {
    let width = rows.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
    for (k, v) in rows {
        println!("{:width$}  {v}", format!("{k}:"), width = width + 1);
    }
}

/// Prints a list either as JSON or as a table built by `row`.
pub fn list<T: Serialize>(
    format: Format,
    items: &[T],
    headers: &[&str],
    row: impl Fn(&T) -> Vec<String>,
) -> anyhow::Result<()> {
    list_wide(format, items, headers, &[], row)
}

/// [`list`] with columns shown only with `-o wide`, after the others, as
/// kubectl shows them: `row` gives a cell for every header, the wide ones
/// last.
pub fn list_wide<T: Serialize>(
    format: Format,
    items: &[T],
    headers: &[&str],
    wide: &[&str],
    row: impl Fn(&T) -> Vec<String>,
) -> anyhow::Result<()> {
    match format {
        Format::Json | Format::Yaml => data(format, items),
        Format::Table | Format::Wide => {
            if items.is_empty() {
                eprintln!("No resources found.");
                return Ok(());
            }
            let (headers, rows) = columns(format, headers, wide, items.iter().map(row).collect());
            table(&headers, rows);
            Ok(())
        }
    }
}

/// The headers and cells a table shows: the wide ones only with `-o wide`.
fn columns<'a>(
    format: Format,
    headers: &[&'a str],
    wide: &[&'a str],
    mut rows: Vec<Vec<String>>,
) -> (Vec<&'a str>, Vec<Vec<String>>) {
    let mut shown = headers.to_vec();
    if format == Format::Wide {
        shown.extend_from_slice(wide);
    } else {
        for r in &mut rows {
            r.truncate(headers.len());
        }
    }
    (shown, rows)
}

/// Age as kubectl shows it: 45s, 12m, 3h, 5d.
pub fn age(t: OffsetDateTime) -> String {
    let secs = (OffsetDateTime::now_utc() - t).whole_seconds().max(0);
    match secs {
        s if s < 120 => format!("{s}s"),
        s if s < 7200 => format!("{}m", s / 60),
        s if s < 172_800 => format!("{}h", s / 3600),
        s => format!("{}d", s / 86_400),
    }
}

/// A value in a cell, `-` when there is none.
pub fn or_dash(v: Option<&str>) -> String {
    v.filter(|s| !s.is_empty()).unwrap_or("-").to_string()
}

/// Items in a cell: comma-separated, `-` for none.
pub fn comma_list<S: AsRef<str>>(items: &[S]) -> String {
    if items.is_empty() {
        return "-".into();
    }
    items.iter().map(AsRef::as_ref).collect::<Vec<_>>().join(",")
}

/// When something last happened, `never` if it has not.
pub fn rfc3339_or_never(t: Option<OffsetDateTime>) -> String {
    t.map(rfc3339).unwrap_or_else(|| "never".into())
}

/// A value as one shell word, for commands printed or handed to a shell:
/// quoted when it holds anything unusual.
pub fn shell_word(v: &str) -> String {
    if !v.is_empty()
        && v.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"/._-+=:@".contains(&b))
    {
        v.to_string()
    } else {
        format!("'{}'", v.replace('\'', r"'\''"))
    }
}

/// UTC, to the millisecond, always the same width: `2026-11-29T19:18:47.410Z`.
pub fn rfc3339(t: OffsetDateTime) -> String {
    const FORMAT: &[time::format_description::BorrowedFormatItem<'_>] = time::macros::format_description!(
        "[year]-[month]-[day]T[hour]:[minute]:[second].[subsecond digits:3]Z"
    );
    t.to_offset(time::UtcOffset::UTC)
        .format(FORMAT)
        .unwrap_or_else(|_| t.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_deletion_reads_as_kind_and_name() {
        let value = Deleted {
            deleted: Object {
                kind: "vm",
                name: "web01",
            },
        };
        assert_eq!(
            serde_json::to_string(&value).unwrap(),
            r#"{"deleted":{"kind":"vm","name":"web01"}}"#
        );
    }

    #[test]
    fn yaml_has_the_json_fields_and_reads_back_the_same() {
        let value = serde_json::json!({
            "name": "web01",
            "port": 8080,
            "ip": "10.0.0.2",
            "labels": {"app": "web", "tier": "true"},
            "empty": {},
            "none": [],
            "reason": null,
            "ready": true,
            "note": "a: b",
            "backends": [
                {"vm": "web01", "health": "healthy"},
                {"vm": "web02", "ports": [22, 80]},
            ],
            "nested": [[1, 2], ["x"]],
            "version": "1.0",
            "time": "2026-12-04T10:00:00.000Z",
        });
        let text = to_yaml(&value);
        let expected = r#"backends:
- health: healthy
  vm: web01
- ports:
  - 22
  - 80
  vm: web02
empty: {}
ip: 10.0.0.2
labels:
  app: web
  tier: "true"
name: web01
nested:
- - 1
  - 2
- - x
none: []
note: "a: b"
port: 8080
ready: true
reason: null
time: "2026-12-04T10:00:00.000Z"
version: "1.0"
"#;
        assert_eq!(text, expected);
        assert_eq!(to_yaml(&serde_json::json!([])), "[]\n");
        assert_eq!(to_yaml(&serde_json::json!("")), "\"\"\n");
    }

    #[test]
    fn shell_words_are_quoted_only_when_they_need_it() {
        assert_eq!(shell_word("/usr/bin/otherix"), "/usr/bin/otherix");
        assert_eq!(shell_word("grant:acme"), "grant:acme");
        assert_eq!(shell_word("/tmp/my dir/otherix"), "'/tmp/my dir/otherix'");
        assert_eq!(shell_word("it's"), "'it'\\''s'");
        assert_eq!(shell_word(""), "''");
    }

    #[test]
    fn wide_columns_show_only_with_o_wide() {
        let rows = || {
            vec![vec![
                "web01".to_string(),
                "running".into(),
                "02:00:00:00:00:01".into(),
            ]]
        };
        let (h, r) = columns(Format::Table, &["NAME", "STATE"], &["MAC"], rows());
        assert_eq!(h, ["NAME", "STATE"]);
        assert_eq!(r, [["web01", "running"]]);
        let (h, r) = columns(Format::Wide, &["NAME", "STATE"], &["MAC"], rows());
        assert_eq!(h, ["NAME", "STATE", "MAC"]);
        assert_eq!(r, rows());
    }

    #[test]
    fn empty_lists_are_a_dash() {
        assert_eq!(comma_list::<&str>(&[]), "-");
        assert_eq!(comma_list(&["n1", "n2"]), "n1,n2");
    }

    #[test]
    fn times_are_utc_to_the_millisecond_with_a_fixed_width() {
        let t = time::macros::datetime!(2026-11-29 19:18:47.41 +01:00);
        assert_eq!(rfc3339(t), "2026-11-29T18:18:47.410Z");
        let t = time::macros::datetime!(2026-01-02 03:04:05 UTC);
        assert_eq!(rfc3339(t), "2026-01-02T03:04:05.000Z");
    }
}
