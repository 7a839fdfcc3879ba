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

#[cfg(test)]
mod tests {
    use super::parse_ms;

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
}
