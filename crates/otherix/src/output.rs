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

/// Reports a change: the object as JSON, or one line for people.
pub fn done<T: Serialize>(format: Format, value: &T, line: &str) -> anyhow::Result<()> {
    match format {
        Format::Json => json(value),
        Format::Table => {
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
    match format {
        Format::Json => json(items),
        Format::Table => {
            if items.is_empty() {
                eprintln!("No resources found.");
            } else {
                table(headers, items.iter().map(row).collect());
            }
            Ok(())
        }
    }
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
    fn shell_words_are_quoted_only_when_they_need_it() {
        assert_eq!(shell_word("/usr/bin/otherix"), "/usr/bin/otherix");
        assert_eq!(shell_word("grant:acme"), "grant:acme");
        assert_eq!(shell_word("/tmp/my dir/otherix"), "'/tmp/my dir/otherix'");
        assert_eq!(shell_word("it's"), "'it'\\''s'");
        assert_eq!(shell_word(""), "''");
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
