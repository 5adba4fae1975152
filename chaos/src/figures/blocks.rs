//! Generated blocks in Markdown: the text between
//! `<!-- figures:NAME:begin -->` and `<!-- figures:NAME:end -->`, each
//! marker alone on its line. Parsing is strict (a lone, crossed or nested
//! marker is an error), so a broken pair never lets hand-written text pass
//! as generated or the other way round.

use std::ops::Range;

/// One marker pair and what lies between.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Block {
    pub name: String,
    /// Byte range of the body: from the start of the line after the begin
    /// marker to the start of the end marker's line.
    pub body: Range<usize>,
    /// 1-based lines of the two markers.
    pub begin_line: usize,
    pub end_line: usize,
}

/// Why the markers of a text do not pair up.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MarkerError {
    #[error("line {line}: `{name}` begins inside the block `{open}` (begun on line {open_line})")]
    Nested { line: usize, name: String, open: String, open_line: usize },
    #[error("line {line}: `{name}` ends without a begin")]
    EndWithoutBegin { line: usize, name: String },
    #[error("line {line}: `{name}` ends while `{open}` (begun on line {open_line}) is open")]
    Crossed { line: usize, name: String, open: String, open_line: usize },
    #[error("line {line}: `{name}` begins and never ends")]
    Unclosed { line: usize, name: String },
    #[error("line {line}: a figures marker that is not alone on its line or not `<!-- figures:NAME:begin|end -->`")]
    Malformed { line: usize },
}

/// The begin marker of `name`.
pub fn begin(name: &str) -> String {
    format!("<!-- figures:{name}:begin -->")
}

/// The end marker of `name`.
pub fn end(name: &str) -> String {
    format!("<!-- figures:{name}:end -->")
}

enum Marker<'a> {
    Begin(&'a str),
    End(&'a str),
}

/// A line's marker, `Ok(None)` for a line without one.
fn marker(line: &str) -> Result<Option<Marker<'_>>, ()> {
    if !line.contains("<!-- figures:") {
        return Ok(None);
    }
    let inner =
        line.trim_end().strip_prefix("<!-- figures:").and_then(|l| l.strip_suffix(" -->")).ok_or(())?;
    let (name, kind) = inner.rsplit_once(':').ok_or(())?;
    let named = !name.is_empty() && name.chars().all(|c| c.is_ascii_lowercase() || c == '-');
    match (named, kind) {
        (true, "begin") => Ok(Some(Marker::Begin(name))),
        (true, "end") => Ok(Some(Marker::End(name))),
        _ => Err(()),
    }
}

/// Every block of `text`, in order.
pub fn parse(text: &str) -> Result<Vec<Block>, MarkerError> {
    let mut blocks = Vec::new();
    let mut open: Option<(String, usize, usize)> = None;
    let mut offset = 0;
    for (i, line) in text.split_inclusive('\n').enumerate() {
        let n = i + 1;
        let next = offset + line.len();
        match marker(line).map_err(|()| MarkerError::Malformed { line: n })? {
            None => {}
            Some(Marker::Begin(name)) => {
                if let Some((o, ol, _)) = open {
                    return Err(MarkerError::Nested { line: n, name: name.into(), open: o, open_line: ol });
                }
                open = Some((name.to_string(), n, next));
            }
            Some(Marker::End(name)) => match open.take() {
                None => return Err(MarkerError::EndWithoutBegin { line: n, name: name.into() }),
                Some((o, ol, _)) if o != name => {
                    return Err(MarkerError::Crossed { line: n, name: name.into(), open: o, open_line: ol })
                }
                Some((o, ol, start)) => {
                    blocks.push(Block { name: o, body: start..offset, begin_line: ol, end_line: n })
                }
            },
        }
        offset = next;
    }
    match open {
        Some((name, line, _)) => Err(MarkerError::Unclosed { line, name }),
        None => Ok(blocks),
    }
}

/// `text` with the body of every block named `name` replaced by `body`
/// (which ends with a newline), and how many blocks that was.
pub fn replace(text: &str, name: &str, body: &str) -> Result<(String, usize), MarkerError> {
    let mut out = String::with_capacity(text.len() + body.len());
    let mut from = 0;
    let mut n = 0;
    for b in parse(text)?.into_iter().filter(|b| b.name == name) {
        out.push_str(&text[from..b.body.start]);
        out.push_str(body);
        from = b.body.end;
        n += 1;
    }
    out.push_str(&text[from..]);
    Ok((out, n))
}

/// `text` with every block's body left out (the markers stay), for checks
/// of what was written by hand.
pub fn outside(text: &str, blocks: &[Block]) -> String {
    let mut out = String::with_capacity(text.len());
    let mut from = 0;
    for b in blocks {
        out.push_str(&text[from..b.body.start]);
        // Keep the line count, so a finding names the right line.
        out.extend(text[b.body.clone()].matches('\n').map(|_| '\n'));
        from = b.body.end;
    }
    out.push_str(&text[from..]);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = "intro\n<!-- figures:chaos:begin -->\nold\ntable\n<!-- figures:chaos:end -->\noutro\n";

    #[test]
    fn a_pair_is_found_with_its_body_and_lines() {
        let b = parse(TEXT).unwrap();
        assert_eq!(b.len(), 1);
        assert_eq!(b[0].name, "chaos");
        assert_eq!(&TEXT[b[0].body.clone()], "old\ntable\n");
        assert_eq!((b[0].begin_line, b[0].end_line), (2, 5));
    }

    #[test]
    fn replace_swaps_the_body_only() {
        let (t, n) = replace(TEXT, "chaos", "new\n").unwrap();
        assert_eq!(n, 1);
        assert_eq!(t, "intro\n<!-- figures:chaos:begin -->\nnew\n<!-- figures:chaos:end -->\noutro\n");
        let (same, none) = replace(TEXT, "performance", "x\n").unwrap();
        assert_eq!((same.as_str(), none), (TEXT, 0));
    }

    #[test]
    fn outside_keeps_lines_and_drops_bodies() {
        let b = parse(TEXT).unwrap();
        let o = outside(TEXT, &b);
        assert!(!o.contains("old"));
        assert_eq!(o.lines().count(), TEXT.lines().count());
        assert_eq!(o.lines().nth(5), Some("outro"));
    }

    #[test]
    fn broken_pairs_are_errors() {
        let b = "<!-- figures:chaos:begin -->\n";
        let e = "<!-- figures:chaos:end -->\n";
        let p = "<!-- figures:performance:begin -->\n";
        let pe = "<!-- figures:performance:end -->\n";
        assert!(matches!(parse(b), Err(MarkerError::Unclosed { line: 1, .. })));
        assert!(matches!(parse(e), Err(MarkerError::EndWithoutBegin { line: 1, .. })));
        assert!(matches!(parse(&format!("{b}{p}{pe}{e}")), Err(MarkerError::Nested { line: 2, .. })));
        assert!(matches!(parse(&format!("{b}{pe}")), Err(MarkerError::Crossed { line: 2, .. })));
        assert!(matches!(
            parse("text <!-- figures:chaos:begin -->\n"),
            Err(MarkerError::Malformed { line: 1 })
        ));
        assert!(matches!(parse("<!-- figures:chaos:start -->\n"), Err(MarkerError::Malformed { line: 1 })));
    }
}
