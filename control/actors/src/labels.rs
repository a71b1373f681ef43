//! Prometheus label sets whose values are escaped as the exposition format requires, for every
//! process's `/metrics` (the agent's and the controller's router and actors).

/// A label set whose values are escaped as the exposition format requires.
pub type Labels = Vec<(&'static str, LabelValue)>;

/// A label value. prometheus-client writes label values as they are, so a `"`, `\\` or
/// newline in an operator-chosen name (a pool, a GPU product) would break the whole scrape;
/// this escapes them.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct LabelValue(String);

impl From<String> for LabelValue {
    fn from(s: String) -> Self {
        LabelValue(s)
    }
}

impl From<&str> for LabelValue {
    fn from(s: &str) -> Self {
        LabelValue(s.to_string())
    }
}

impl prometheus_client::encoding::EncodeLabelValue for LabelValue {
    fn encode(&self, encoder: &mut prometheus_client::encoding::LabelValueEncoder) -> Result<(), std::fmt::Error> {
        use std::fmt::Write;
        for c in self.0.chars() {
            match c {
                '\\' => encoder.write_str("\\\\")?,
                '"' => encoder.write_str("\\\"")?,
                '\n' => encoder.write_str("\\n")?,
                c => encoder.write_char(c)?,
            }
        }
        Ok(())
    }
}

/// Labels from `(name, value)` pairs.
pub fn labels<const N: usize>(pairs: [(&'static str, String); N]) -> Labels {
    pairs.into_iter().map(|(k, v)| (k, LabelValue(v))).collect()
}
