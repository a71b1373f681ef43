//! Text that came from outside (a request, a peer) and goes into logs, audit lines and error
//! messages: clipped, so a caller cannot make the controller write what it sent at any length.

/// `s`, cut to at most `max_chars` characters (on a character boundary), with how long it was
/// when cut.
pub fn clip(s: &str, max_chars: usize) -> String {
    match s.char_indices().nth(max_chars) {
        None => s.to_string(),
        Some((end, _)) => format!("{}… ({} bytes in all)", &s[..end], s.len()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_text_is_cut_on_a_character_boundary() {
        assert_eq!(clip("gpu-1", 8), "gpu-1");
        let long = "é".repeat(100);
        let c = clip(&long, 10);
        assert!(
            c.starts_with(&"é".repeat(10)) && c.ends_with("(200 bytes in all)"),
            "{c}"
        );
    }
}
