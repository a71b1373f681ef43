//! How every command prints what it got: `-o table` (the default, columns chosen for people),
//! `-o wide` (every field the command has, as columns), `-o json` and `-o yaml` (the same
//! document, for programs). Each command builds its document once, as JSON, and its table;
//! [`print`] picks.

use clap::ValueEnum;
use serde_json::Value;

/// Output format.
#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
pub enum Output {
    /// Columns chosen for people.
    Table,
    /// Every field of each row, as columns (a single object: one field a line).
    Wide,
    /// The command's document as JSON.
    Json,
    /// The same document as YAML.
    Yaml,
}

impl Output {
    /// The document in this format, for a structured format (`json`, `yaml`); `None` for the
    /// ones a table is shown for.
    pub fn document(self, value: &Value) -> Option<String> {
        match self {
            Output::Json => Some(serde_json::to_string_pretty(value).expect("a JSON value serialises")),
            Output::Yaml => Some(
                serde_yaml_ng::to_string(value)
                    .expect("a JSON value serialises as YAML")
                    .trim_end()
                    .to_string(),
            ),
            Output::Table | Output::Wide => None,
        }
    }

    /// JSON or YAML: the document, not a table.
    pub fn is_document(self) -> bool {
        matches!(self, Output::Json | Output::Yaml)
    }
}

/// Prints `value` as `out` says: the document, every field of it (`wide`), or `table()`.
pub fn print(out: Output, value: Value, table: impl FnOnce() -> String) {
    match out.document(&value) {
        Some(doc) => outln!("{doc}"),
        None if out == Output::Wide => match wide(&value) {
            Some(t) => outln!("{t}"),
            None => outln!("{}", table()),
        },
        None => outln!("{}", table()),
    }
}

/// Prints records that arrive as a stream (events, audit entries, actor trees): JSON one
/// compact object a line (NDJSON, for `jq` and log shippers), YAML one `---` document each,
/// `wide` every field as columns, else `table()`.
pub fn print_records(out: Output, records: &[Value], table: impl FnOnce() -> String) {
    match out {
        Output::Json => records.iter().for_each(|r| outln!("{r}")),
        Output::Yaml => {
            for r in records {
                outln!("---\n{}", Output::Yaml.document(r).expect("yaml"));
            }
        }
        Output::Wide if records.is_empty() => {}
        Output::Wide => outln!("{}", wide(&Value::Array(records.to_vec())).expect("a list")),
        Output::Table => out!("{}", table()),
    }
}

/// Every field of a list (an array of objects) as columns; of an object holding one list (a
/// cluster's `members`), its other fields a line each and then the list; of any other object,
/// `FIELD  value` lines. Nested values as compact JSON. `None` for a document with no fields (a
/// bare number or `null`): the command's own table says it better.
pub fn wide(value: &Value) -> Option<String> {
    match value {
        Value::Array(rows) => Some(rows_table(rows)),
        Value::Object(fields) => {
            let lists: Vec<&String> = fields.iter().filter(|(_, v)| is_rows(v)).map(|(k, _)| k).collect();
            let [list] = lists[..] else {
                return Some(fields_table(fields));
            };
            let rest: serde_json::Map<String, Value> = fields
                .iter()
                .filter(|(k, _)| *k != list)
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            let rows = rows_table(fields[list].as_array().expect("a list"));
            Some(if rest.is_empty() {
                rows
            } else {
                format!("{}\n\n{rows}", fields_table(&rest))
            })
        }
        _ => None,
    }
}

fn rows_table(rows: &[Value]) -> String {
    if rows.is_empty() {
        return "(none)".into();
    }
    // What names a row first, then its plain fields, then nested ones (long), each by name.
    let mut columns: Vec<&str> = Vec::new();
    for row in rows.iter().filter_map(Value::as_object) {
        for k in row.keys() {
            if !columns.contains(&k.as_str()) {
                columns.push(k);
            }
        }
    }
    let rank = |c: &str| {
        let nested = rows
            .iter()
            .any(|r| matches!(r.get(c), Some(Value::Array(_) | Value::Object(_))));
        (
            !IDENTITY.contains(&c),
            nested,
            IDENTITY.iter().position(|i| *i == c),
            c.to_string(),
        )
    };
    columns.sort_by_key(|c| rank(c));
    let cells: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            columns
                .iter()
                .map(|c| cell(r.get(*c).unwrap_or(&Value::Null)))
                .collect()
        })
        .collect();
    let header: Vec<String> = columns.iter().map(|c| c.to_uppercase()).collect();
    let widths: Vec<usize> = (0..columns.len())
        .map(|i| {
            cells
                .iter()
                .map(|r| r[i].chars().count())
                .chain([header[i].len()])
                .max()
                .unwrap_or(0)
        })
        .collect();
    let line = |r: &[String]| -> String {
        r.iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect::<Vec<_>>()
            .join("  ")
            .trim_end()
            .to_string()
    };
    let mut out = vec![line(&header)];
    out.extend(cells.iter().map(|r| line(r)));
    out.join("\n")
}

/// Fields that name a row: its first columns, in this order.
const IDENTITY: &[&str] = &["name", "id", "node_id", "model", "class", "tenant", "hostname", "addr"];

fn is_rows(v: &Value) -> bool {
    matches!(v, Value::Array(rows) if !rows.is_empty() && rows.iter().all(Value::is_object))
}

fn fields_table(fields: &serde_json::Map<String, Value>) -> String {
    let width = fields.keys().map(|k| k.len()).max().unwrap_or(0);
    fields
        .iter()
        .map(|(k, v)| format!("{:<width$}  {}", k.to_uppercase(), cell(v)))
        .collect::<Vec<_>>()
        .join("\n")
}

fn cell(v: &Value) -> String {
    match v {
        Value::Null => "-".into(),
        Value::String(s) if s.is_empty() => "-".into(),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn wide_shows_every_field_of_every_row() {
        let rows = json!([
            {"name": "a", "ready": 2, "labels": {"zone": "x"}},
            {"name": "bb", "ready": null, "extra": "only here"},
        ]);
        assert_eq!(
            wide(&rows).unwrap(),
            "NAME  EXTRA      READY  LABELS\n\
             a     -          2      {\"zone\":\"x\"}\n\
             bb    only here  -      -"
        );
        // A list held by an object (`{"members": […]}`) is the list, after the object's
        // other fields; an object with no list is shown field by field.
        assert_eq!(wide(&json!({"m": [{"k": 1}]})).unwrap(), "K\n1");
        assert_eq!(wide(&json!({"term": 3, "m": [{"k": 1}]})).unwrap(), "TERM  3\n\nK\n1");
        assert_eq!(
            wide(&json!({"log_index": 7, "previous": ""})).unwrap(),
            "LOG_INDEX  7\nPREVIOUS   -"
        );
        assert_eq!(wide(&json!([])).unwrap(), "(none)");
        assert_eq!(wide(&json!(null)), None);
    }

    #[test]
    fn yaml_is_the_same_document_as_json() {
        let v = json!({"members": [{"node_id": 1, "addr": "127.0.0.1:7001"}], "leader": null});
        let yaml = Output::Yaml.document(&v).unwrap();
        let back: Value = serde_yaml_ng::from_str(&yaml).unwrap();
        assert_eq!(back, v);
        assert!(yaml.contains("node_id: 1"), "{yaml}");
        assert_eq!(Output::Table.document(&v), None);
    }
}
