//! Python frames put in place of the eval-loop frames that run them.

/// Where `python[at]` goes in `merge(native, python)` (root first): the frames before it
/// are those below a task's coroutine (the event loop's).
pub(super) fn first_at(native: &[(u32, bool)], python: &[(u32, bool)], at: usize) -> Option<usize> {
    // Marks each Python frame with its index, merges the marks, and finds `at`'s.
    let marked: Vec<(u32, bool)> = python
        .iter()
        .enumerate()
        .map(|(i, &(_, e))| (u32::MAX - i as u32, e))
        .collect();
    let native: Vec<(u32, bool)> = native.iter().map(|&(_, e)| (0, e)).collect();
    merge(&native, &marked)
        .iter()
        .position(|&id| id == u32::MAX - at as u32)
}

/// Puts the Python frames in place of the eval-loop frames that run them. Both lists are
/// leaf first; `python` frames flagged `true` start a run of one eval-loop call (its
/// outermost frame). The k-th eval-loop frame from the leaf runs the k-th run. Runs left
/// over (native unwinding stopped short) go at the root; the result is root first.
pub(super) fn merge(native: &[(u32, bool)], python: &[(u32, bool)]) -> Vec<u32> {
    let mut runs: Vec<&[(u32, bool)]> = Vec::new();
    let mut start = 0;
    for (i, &(_, entry)) in python.iter().enumerate() {
        if entry {
            runs.push(&python[start..=i]);
            start = i + 1;
        }
    }
    if start < python.len() {
        runs.push(&python[start..]);
    }
    let mut runs = runs.into_iter();
    let mut leaf_first = Vec::with_capacity(native.len() + python.len());
    for &(id, eval) in native {
        match eval.then(|| runs.next()).flatten() {
            Some(run) => leaf_first.extend(run.iter().map(|&(f, _)| f)),
            None => leaf_first.push(id),
        }
    }
    for run in runs {
        leaf_first.extend(run.iter().map(|&(f, _)| f));
    }
    leaf_first.reverse();
    leaf_first
}

#[cfg(test)]
mod tests {
    use super::merge;

    #[test]
    fn a_task_frame_is_found_where_it_merges() {
        let native = [(1, false), (2, true), (3, false), (4, true), (5, false)];
        let python = [(10, false), (11, true), (12, true)];
        // Root first: 5 12 3 11 10 1.
        assert_eq!(super::first_at(&native, &python, 1), Some(3));
        assert_eq!(super::first_at(&native, &python, 2), Some(1));
        assert_eq!(super::first_at(&native, &python, 0), Some(4));
    }

    #[test]
    fn python_runs_replace_eval_frames_in_order() {
        // Native, leaf first: leaf(1) eval(2) call(3) eval(4) main(5).
        let native = [(1, false), (2, true), (3, false), (4, true), (5, false)];
        // Python, leaf first: c(10) b(11, starts run) a(12, starts run).
        let python = [(10, false), (11, true), (12, true)];
        assert_eq!(merge(&native, &python), vec![5, 12, 3, 11, 10, 1]);
    }

    #[test]
    fn runs_without_eval_frames_go_at_the_root() {
        // Unwinding stopped in the first eval frame's caller.
        let native = [(1, false), (2, true), (3, false)];
        let python = [(10, true), (11, true), (12, true)];
        assert_eq!(merge(&native, &python), vec![12, 11, 3, 10, 1]);
    }

    #[test]
    fn extra_eval_frames_stay_native() {
        let native = [(2, true), (4, true)];
        let python = [(10, false), (11, false)];
        assert_eq!(merge(&native, &python), vec![4, 11, 10]);
    }
}
