//! How results reach people and programs: tables or JSON on stdout; nothing
//! else goes to stdout, so `-o json` output can always be piped.

use comfy_table::{presets, ContentArrangement, Table};
use serde::Serialize;
use time::OffsetDateTime;

use crate::cli::Format;

/// Prints `value` as pretty JSON.
pub fn json<T: Serialize + ?Sized>(value: &T) -> anyhow::Result<()> {
    println!("{}", serde_json::to_string_pretty(value)?);
    Ok(())
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

pub fn or_dash(v: Option<&str>) -> String {
    v.filter(|s| !s.is_empty()).unwrap_or("-").to_string()
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
    fn times_are_utc_to_the_millisecond_with_a_fixed_width() {
        let t = time::macros::datetime!(2026-11-29 19:18:47.41 +01:00);
        assert_eq!(rfc3339(t), "2026-11-29T18:18:47.410Z");
        let t = time::macros::datetime!(2026-01-02 03:04:05 UTC);
        assert_eq!(rfc3339(t), "2026-01-02T03:04:05.000Z");
    }
}
