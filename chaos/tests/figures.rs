//! The figures in README.md and docs/**/*.md come from the committed
//! reports (`docs/reports/bench.json`, `docs/reports/chaos.json`): every
//! generated block equals what its report renders, every marker pair is
//! whole, and no performance figure is written by hand outside a block.
//! Fast: no servers, only files.

use chaos::figures::{self, Committed, Figure, Problem};

/// With FIGURES_REGENERATE set (after a renderer changed), rewrites the
/// blocks from the committed reports once, before either test reads the
/// docs (the reports themselves are only written by runs).
fn regenerate_if_asked() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if std::env::var_os("FIGURES_REGENERATE").is_some() {
            for line in figures::regenerate(&figures::root()) {
                eprintln!("figures: {line}");
            }
        }
    });
}

fn tree() -> (Committed, Vec<(String, String)>) {
    regenerate_if_asked();
    let root = figures::root();
    let committed = Committed::read(&root).expect("the committed reports");
    let files = figures::markdown_files(&root)
        .expect("docs/")
        .into_iter()
        .map(|f| {
            let text = std::fs::read_to_string(root.join(&f)).expect("a docs page");
            (f, text)
        })
        .collect();
    (committed, files)
}

#[test]
fn every_figure_in_the_docs_comes_from_the_committed_reports() {
    regenerate_if_asked();
    let problems = figures::check(&figures::root());
    let list: Vec<String> = problems.iter().map(|p| format!("  {p}")).collect();
    assert!(problems.is_empty(), "figures not from the committed reports:\n{}", list.join("\n"));
}

/// The check is not vacuous: each kind of drift in a copy of the real
/// README is caught.
#[test]
fn a_stale_block_a_broken_pair_and_a_hand_copied_figure_are_caught() {
    let (committed, files) = tree();
    let readme = files.iter().find(|(f, _)| f == "README.md").expect("README.md").1.clone();
    let with = |text: String| -> Vec<Problem> {
        let mut f = files.clone();
        f.iter_mut().find(|(n, _)| n == "README.md").expect("README.md").1 = text;
        figures::check_texts(&committed, &f)
    };
    assert!(with(readme.clone()).is_empty(), "the tree as committed passes");

    let body = committed.render(Figure::Chaos);
    let first_row =
        body.lines().find(|l| l.starts_with("| ") && !l.starts_with("| scenario")).expect("a row");
    let edited = readme.replacen(first_row, &first_row.replacen(" | ", " | edited | ", 1), 1);
    assert!(
        matches!(with(edited).as_slice(), [Problem::Stale { name: "chaos", .. }]),
        "an edited chaos row is caught"
    );

    let broken = readme.replacen("<!-- figures:performance:end -->\n", "", 1);
    assert!(
        matches!(with(broken).as_slice(), [Problem::Markers { .. }, ..]),
        "a lone begin marker is caught"
    );

    let stray = format!("{readme}\nMeasured today: 18,352/s at 16 clients, p99 2.1 ms.\n");
    let found: Vec<String> = with(stray)
        .iter()
        .filter_map(|p| match p {
            Problem::Stray { figure, .. } => Some(figure.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(found, ["18,352/s", "2.1 ms"], "hand-copied figures outside a block are caught");

    let gone =
        readme.replace("<!-- figures:chaos:begin -->\n", "").replace("<!-- figures:chaos:end -->\n", "");
    let problems = with(gone);
    assert!(
        problems.iter().any(|p| matches!(p, Problem::Missing { name: "chaos", .. })),
        "a README without its chaos block is caught: {problems:?}"
    );
}
