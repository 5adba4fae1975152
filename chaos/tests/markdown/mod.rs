//! What the docs test reads in a Markdown page: the commands of its ```sh
//! blocks, its relative links and its headings' anchors. Pure text
//! functions, so their rules are unit-tested without a stack.

/// Logical lines (continuations joined, comments dropped) of every ```sh
/// block, in order.
pub fn sh_blocks(text: &str) -> Vec<Vec<String>> {
    let mut blocks = Vec::new();
    let mut cur: Option<Vec<String>> = None;
    let mut pending = String::new();
    for line in text.lines() {
        let t = line.trim_end();
        match (&mut cur, t.trim_start()) {
            (None, "```sh") => cur = Some(Vec::new()),
            (Some(_), "```") => blocks.push(cur.take().unwrap_or_default()),
            (Some(b), l) => {
                if let Some(head) = l.strip_suffix('\\') {
                    pending.push_str(head);
                    pending.push(' ');
                } else {
                    pending.push_str(l);
                    let full = std::mem::take(&mut pending);
                    let command = strip_comment(&full).trim();
                    if !command.is_empty() {
                        b.push(command.to_string());
                    }
                }
            }
            (None, _) => {}
        }
    }
    blocks
}

/// The line without its shell comment: a `#` that starts a word outside
/// quotes begins one, as in `sh` (so `cargo lab bench --quick  # when` is
/// the command `cargo lab bench --quick`, and a `#` inside a URL or a
/// quoted JSON body stays).
pub fn strip_comment(line: &str) -> &str {
    let mut quote: Option<char> = None;
    let mut prev_blank = true;
    for (i, c) in line.char_indices() {
        match quote {
            Some(q) if c == q => quote = None,
            Some(_) => {}
            None if c == '\'' || c == '"' => quote = Some(c),
            None if c == '#' && prev_blank => return &line[..i],
            None => {}
        }
        prev_blank = c.is_whitespace();
    }
    line
}

/// Targets of the inline links `[text](target)` outside code (fences and
/// backticks), in order.
pub fn links(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    for line in prose_lines(text) {
        let mut rest = outside_code_spans(line);
        while let Some(at) = rest.find("](") {
            let after = &rest[at + 2..];
            match after.find(')') {
                Some(end) => {
                    out.push(after[..end].to_string());
                    rest = after[end + 1..].to_string();
                }
                None => break,
            }
        }
    }
    out
}

/// The lines outside fenced code blocks (a `#` or a link in a block is
/// code, not a heading or a link).
fn prose_lines(text: &str) -> impl Iterator<Item = &str> {
    let mut fenced = false;
    text.lines().filter(move |line| {
        let fence = line.trim_start().starts_with("```");
        if fence {
            fenced = !fenced;
        }
        !fence && !fenced
    })
}

/// The line with every `code span` removed (a link inside one is text).
fn outside_code_spans(line: &str) -> String {
    let mut out = String::new();
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '`' {
            out.push(c);
            continue;
        }
        // A span opened by n backticks closes at the next run of n.
        let mut n = 1;
        while chars.peek() == Some(&'`') {
            chars.next();
            n += 1;
        }
        let mut run = 0;
        for d in chars.by_ref() {
            if d == '`' {
                run += 1;
                if run == n {
                    break;
                }
            } else {
                run = 0;
            }
        }
    }
    out
}

/// Anchors of the page's headings as GitHub makes them: lower case, every
/// character but letters, digits, `-`, `_` and spaces dropped, spaces as
/// `-`, and `-1`, `-2`... on repeats.
pub fn anchors(text: &str) -> Vec<String> {
    let mut seen: Vec<String> = Vec::new();
    let mut out = Vec::new();
    for line in prose_lines(text) {
        let Some(title) = heading(line) else { continue };
        let base: String = title
            .to_lowercase()
            .chars()
            .filter(|c| c.is_alphanumeric() || matches!(c, '-' | '_' | ' '))
            .map(|c| if c == ' ' { '-' } else { c })
            .collect();
        let repeats = seen.iter().filter(|s| **s == base).count();
        out.push(if repeats == 0 { base.clone() } else { format!("{base}-{repeats}") });
        seen.push(base);
    }
    out
}

/// The text of an ATX heading line (`## Title`), without its markers.
fn heading(line: &str) -> Option<&str> {
    let hashes = line.len() - line.trim_start_matches('#').len();
    if !(1..=6).contains(&hashes) {
        return None;
    }
    line[hashes..].strip_prefix(' ').map(str::trim)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sh_blocks_join_continuations_and_drop_comments() {
        let text = "x\n```sh\n# a comment\ncurl a \\\n  -d '{\"#\": 1}'\ncargo lab bench --quick   # 2026, every table\n```\n```text\nnot run\n```\n";
        assert_eq!(
            sh_blocks(text),
            vec![vec!["curl a  -d '{\"#\": 1}'".to_string(), "cargo lab bench --quick".to_string()]]
        );
    }

    #[test]
    fn a_hash_inside_a_word_or_quotes_is_no_comment() {
        assert_eq!(strip_comment("curl http://h/p#frag"), "curl http://h/p#frag");
        assert_eq!(strip_comment("echo \"a #b\" # c"), "echo \"a #b\" ");
        assert_eq!(strip_comment("# all of it"), "");
    }

    #[test]
    fn links_skip_code() {
        let text = "[a](x.md) `[b](y.md)` [c](z.md#h)\n```\n[d](w.md)\n```\n``[e](v.md)``";
        assert_eq!(links(text), vec!["x.md", "z.md#h"]);
    }

    #[test]
    fn anchors_are_github_s() {
        let text = "# Title\n## Per-key limits (a user inside a tenant)\n```\n# not a heading\n```\n## Fallback repaid at heal: `partition-heal-repaid`\n### Title\n#hashtag";
        assert_eq!(
            anchors(text),
            vec![
                "title",
                "per-key-limits-a-user-inside-a-tenant",
                "fallback-repaid-at-heal-partition-heal-repaid",
                "title-1"
            ]
        );
    }
}
