//! Identifier validation. Tenants, resources, regions and agent ids end up in
//! SQL rows, Redis keys and metric labels, so one rule guards all of them.

/// The longest identifier accepted (the regex allows 1 + 63 characters).
pub const MAX_ID_LEN: usize = 64;

/// Why an identifier was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IdError {
    /// The identifier is empty.
    Empty,
    /// Longer than [`MAX_ID_LEN`] bytes.
    TooLong(usize),
    /// The first character must be alphanumeric.
    BadStart,
    /// A character outside `[A-Za-z0-9._-]`.
    BadChar(char),
}

impl std::fmt::Display for IdError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            IdError::Empty => write!(f, "must not be empty"),
            IdError::TooLong(n) => write!(f, "is {n} characters long, at most {MAX_ID_LEN} allowed"),
            IdError::BadStart => write!(f, "must start with a letter or digit"),
            IdError::BadChar(c) => {
                write!(f, "contains {c:?}; only letters, digits, '.', '_' and '-' are allowed")
            }
        }
    }
}

/// Checks `s` against `^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$`.
pub fn validate_id(s: &str) -> Result<(), IdError> {
    let first = s.chars().next().ok_or(IdError::Empty)?;
    if s.len() > MAX_ID_LEN {
        return Err(IdError::TooLong(s.chars().count()));
    }
    if !first.is_ascii_alphanumeric() {
        return Err(IdError::BadStart);
    }
    match s.chars().find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))) {
        Some(c) => Err(IdError::BadChar(c)),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_the_documented_alphabet() {
        for ok in ["a", "atlas", "eu-1", "A.b_c-9", &"x".repeat(64)] {
            assert_eq!(validate_id(ok), Ok(()), "{ok}");
        }
    }

    #[test]
    fn refuses_everything_else() {
        assert_eq!(validate_id(""), Err(IdError::Empty));
        assert_eq!(validate_id(&"x".repeat(65)), Err(IdError::TooLong(65)));
        assert_eq!(validate_id("-a"), Err(IdError::BadStart));
        assert_eq!(validate_id("a/b"), Err(IdError::BadChar('/')));
        assert_eq!(validate_id("a{b}"), Err(IdError::BadChar('{')));
        assert_eq!(validate_id("é"), Err(IdError::BadStart));
    }
}
