//! Durations on the command line: `500ms`, `30s`, `5m`, `1h`, or plain seconds.

pub fn parse_ms(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let split = s
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: f64 = num
        .parse()
        .map_err(|_| format!("invalid duration '{s}' (examples: 500ms, 30s, 5m, 1h)"))?;
    let scale = match unit {
        "ms" => 1.0,
        "" | "s" => 1e3,
        "m" => 60e3,
        "h" => 3600e3,
        _ => {
            return Err(format!(
                "invalid duration unit '{unit}' in '{s}' (use ms, s, m or h)"
            ))
        }
    };
    Ok((n * scale).round() as u64)
}

/// A duration in microseconds: `500us`, or anything [`parse_ms`] takes (`1ms`, `0.5ms`).
pub fn parse_us(s: &str) -> Result<u64, String> {
    match s.trim().strip_suffix("us") {
        Some(n) => n
            .trim()
            .parse::<f64>()
            .ok()
            .filter(|n| n.is_finite() && *n >= 0.0)
            .map(|n| n.round() as u64)
            .ok_or_else(|| format!("invalid duration '{s}' (examples: 500us, 2ms)")),
        None => {
            let s = s.trim();
            // Fractions of a millisecond: parse_ms rounds to whole ones.
            let split = s
                .find(|c: char| !c.is_ascii_digit() && c != '.')
                .unwrap_or(s.len());
            if &s[split..] == "ms" {
                let n: f64 = s[..split]
                    .parse()
                    .map_err(|_| format!("invalid duration '{s}' (examples: 500us, 2ms)"))?;
                return Ok((n * 1e3).round() as u64);
            }
            parse_ms(s).map(|ms| ms.saturating_mul(1000))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{parse_ms, parse_us};

    #[test]
    fn durations_parse() {
        assert_eq!(parse_ms("500ms"), Ok(500));
        assert_eq!(parse_ms("2"), Ok(2000));
        assert_eq!(parse_ms("1.5s"), Ok(1500));
        assert_eq!(parse_ms("5m"), Ok(300_000));
        assert_eq!(parse_ms("1h"), Ok(3_600_000));
        assert_eq!(parse_ms("0"), Ok(0));
        assert!(parse_ms("ten").is_err());
        assert!(parse_ms("5d").is_err());
    }

    #[test]
    fn microseconds_parse() {
        assert_eq!(parse_us("500us"), Ok(500));
        assert_eq!(parse_us("0.5ms"), Ok(500));
        assert_eq!(parse_us("2ms"), Ok(2000));
        assert_eq!(parse_us("1s"), Ok(1_000_000));
        assert!(parse_us("fast").is_err());
        assert!(parse_us("-5us").is_err());
    }
}
