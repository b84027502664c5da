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

/// `value` as pretty JSON whose every unprintable character (see `unprintable`) inside a string
/// is written as a `\uXXXX` escape: the same JSON values, and nothing a terminal acts on.
/// serde_json escapes C0 controls itself (RFC 8259 §7 requires it) but writes DEL, C1 and the
/// bidirectional controls as they are, which JSON allows and a terminal obeys.
pub fn json_pretty<T: serde::Serialize + ?Sized>(value: &T) -> serde_json::Result<String> {
    let mut out = Vec::new();
    let mut ser = serde_json::Serializer::with_formatter(&mut out, Escaping(serde_json::ser::PrettyFormatter::new()));
    value.serialize(&mut ser)?;
    // serde_json writes only UTF-8 (its input is `str`, and every escape is ASCII).
    Ok(String::from_utf8_lossy(&out).into_owned())
}

/// A formatter that escapes `unprintable` characters in strings and otherwise formats as the
/// one it wraps.
struct Escaping<F>(F);

impl<F: serde_json::ser::Formatter> serde_json::ser::Formatter for Escaping<F> {
    fn write_string_fragment<W: ?Sized + std::io::Write>(&mut self, w: &mut W, fragment: &str) -> std::io::Result<()> {
        let mut rest = fragment;
        while let Some(at) = rest.find(unprintable) {
            w.write_all(&rest.as_bytes()[..at])?;
            let c = rest[at..].chars().next().unwrap_or('\u{fffd}');
            // Every unprintable character is in the Basic Multilingual Plane: one escape.
            write!(w, "\\u{:04x}", c as u32)?;
            rest = &rest[at + c.len_utf8()..];
        }
        w.write_all(rest.as_bytes())
    }
    fn begin_array<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.0.begin_array(w)
    }
    fn end_array<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.0.end_array(w)
    }
    fn begin_array_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W, first: bool) -> std::io::Result<()> {
        self.0.begin_array_value(w, first)
    }
    fn end_array_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.0.end_array_value(w)
    }
    fn begin_object<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.0.begin_object(w)
    }
    fn end_object<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.0.end_object(w)
    }
    fn begin_object_key<W: ?Sized + std::io::Write>(&mut self, w: &mut W, first: bool) -> std::io::Result<()> {
        self.0.begin_object_key(w, first)
    }
    fn begin_object_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.0.begin_object_value(w)
    }
    fn end_object_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.0.end_object_value(w)
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn json_for_a_terminal_escapes_every_control_and_keeps_the_value() {
        let s = "a\u{1b}[2Jb\u{7f}c\u{9b}31md\u{202e}e\u{2066}f\u{061c}g\tok é";
        let text = super::json_pretty(&serde_json::json!({ "k\u{85}": s })).unwrap();
        assert!(!text.chars().any(|c| super::unprintable(c) && c != '\n'), "{text:?}");
        assert!(text.contains("\\u007f") && text.contains("\\u009b") && text.contains("\\u202e"), "{text}");
        let back: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(back["k\u{85}"], s);
    }
}
