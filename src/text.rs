//! Text from someone else — a bundle, a process's name, a kernel log line — made safe to print:
//! the one rule for what may reach a terminal or a page, kept at the bottom of the house so that
//! every room that reads such text (`collect`, `report`) applies the same one.

/// Whether `c` may reach a terminal or a page from someone else's text.
pub fn unprintable(c: char) -> bool {
    match c {
        '\n' | '\t' => false,
        // C0, DEL, C1 (ECMA-48: ESC starts a sequence; in UTF-8, U+009B is CSI on terminals
        // that take 8-bit controls).
        '\u{0}'..='\u{1f}' | '\u{7f}'..='\u{9f}' => true,
        // Unicode's bidirectional formatting characters (UAX #9, "Explicit Directional
        // Formatting"), the marks among them: text that reads differently than it is.
        '\u{061c}' | '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}' => true,
        _ => false,
    }
}

/// `s` with every unprintable character (see `unprintable`) replaced by U+FFFD.
pub fn printable(s: &str) -> std::borrow::Cow<'_, str> {
    if !s.chars().any(unprintable) {
        return std::borrow::Cow::Borrowed(s);
    }
    std::borrow::Cow::Owned(s.chars().map(|c| if unprintable(c) { '\u{fffd}' } else { c }).collect())
}
