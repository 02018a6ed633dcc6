//! Sizes as people write them: 512, 4K, 10M, 1.5G, 2T, 64MiB.

/// Parses a size with an optional binary suffix (K, M, G, T, P; also KiB, KB).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, suffix) = t.split_at(split);
    let shift = match suffix.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        "p" | "pb" | "pib" => 50,
        _ => return Err(format!("{s:?} is not a size: use a number with an optional K, M, G or T suffix, e.g. 10G")),
    };
    let bad = || format!("{s:?} is not a size: use a number with an optional K, M, G or T suffix, e.g. 10G");
    if num.is_empty() {
        return Err(bad());
    }
    let bytes = if num.contains('.') {
        let v: f64 = num.parse().map_err(|_| bad())?;
        let b = v * (1u64 << shift) as f64;
        if !(b.is_finite() && b < u64::MAX as f64) {
            return Err(format!("{s:?} is too large"));
        }
        b.round() as u64
    } else {
        let v: u64 = num.parse().map_err(|_| bad())?;
        v.checked_mul(1 << shift).ok_or_else(|| format!("{s:?} is too large"))?
    };
    if bytes == 0 {
        return Err(format!("{s:?}: a disk needs a size above zero"));
    }
    if bytes > i64::MAX as u64 {
        return Err(format!("{s:?} is too large"));
    }
    Ok(bytes)
}

/// 1073741824 → "1 GiB", 1536 → "1.5 KiB".
pub fn human(bytes: u64) -> String {
    human_as(bytes, false)
}

/// Always one decimal, as a progress line shows sizes: 33554432 → "32.0 MiB".
pub fn one_decimal(bytes: u64) -> String {
    human_as(bytes, true)
}

fn human_as(bytes: u64, one_decimal: bool) -> String {
    const UNITS: [&str; 6] = ["bytes", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{bytes} bytes")
    } else if v.fract() == 0.0 && !one_decimal {
        format!("{v} {}", UNITS[u])
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("512"), Ok(512));
        assert_eq!(parse_size("4K"), Ok(4096));
        assert_eq!(parse_size("10m"), Ok(10 << 20));
        assert_eq!(parse_size("1.5G"), Ok(3 << 29));
        assert_eq!(parse_size("2TiB"), Ok(2 << 40));
        assert!(parse_size("abc").is_err());
        assert!(parse_size("12Q").is_err());
        assert!(parse_size("0").is_err());
        assert!(parse_size("").is_err());
        assert!(parse_size("99999999999T").is_err());
        assert_eq!(human(1 << 30), "1 GiB");
        assert_eq!(human(1536), "1.5 KiB");
        assert_eq!(human(7), "7 bytes");
    }
}
