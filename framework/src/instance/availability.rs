//! Availability arithmetic: what a parent's instances use of each resource, how many more
//! instances of a type fit, and which resource stops the next one. Pure functions over the
//! parent's declarations and the needs of its instances; the registry feeds them its
//! contents on every query, so there is no counter to keep in step.

use super::{InstanceType, Resource};

/// Per resource of `resources` (same order), the sum of what `takers` need of it. A need
/// naming a resource the parent does not declare is ignored here (the registry refuses such
/// a type when the parent registers). Sums saturate: a total is at most `u64::MAX`.
pub(super) fn used<'a>(
    resources: &[Resource],
    takers: impl IntoIterator<Item = &'a [(String, u64)]>,
) -> Vec<u64> {
    let mut used = vec![0u64; resources.len()];
    for needs in takers {
        for (name, amount) in needs {
            if let Some(i) = resources.iter().position(|r| &r.name == name) {
                used[i] = used[i].saturating_add(*amount);
            }
        }
    }
    used
}

/// What is left of resource `i`.
fn left(resources: &[Resource], used: &[u64], i: usize) -> u64 {
    resources[i].total.saturating_sub(used[i])
}

/// How many more instances of `ty` the resources allow (`u64::MAX` when the type needs
/// nothing: only the registry's instance limit bounds it then). A need of a resource the
/// parent does not declare allows none.
pub(super) fn available(ty: &InstanceType, resources: &[Resource], used: &[u64]) -> u64 {
    let mut n = u64::MAX;
    for (name, amount) in &ty.needs {
        if *amount == 0 {
            continue;
        }
        let fit = match resources.iter().position(|r| &r.name == name) {
            Some(i) => left(resources, used, i) / amount,
            None => 0,
        };
        n = n.min(fit);
    }
    n
}

/// The first resource that has less left than one more instance of `ty` needs:
/// `(resource, needed, left)`.
pub(super) fn shortfall<'a>(
    ty: &InstanceType,
    resources: &'a [Resource],
    used: &[u64],
) -> Option<(&'a Resource, u64, u64)> {
    ty.needs.iter().find_map(|(name, amount)| {
        let i = resources.iter().position(|r| &r.name == name)?;
        let left = left(resources, used, i);
        (left < *amount).then_some((&resources[i], *amount, left))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn res(name: &str, total: u64) -> Resource {
        Resource {
            name: name.into(),
            unit: "u".into(),
            total,
        }
    }

    fn ty(needs: &[(&str, u64)]) -> InstanceType {
        InstanceType {
            name: "t".into(),
            description: String::new(),
            device_api: "vfio-pci".into(),
            needs: needs.iter().map(|(n, a)| (n.to_string(), *a)).collect(),
        }
    }

    #[test]
    fn test_available_min_over_needs_counts_what_takers_use() {
        let resources = [res("fb", 64), res("slots", 3)];
        let big = ty(&[("fb", 16), ("slots", 1)]);
        let small = ty(&[("fb", 4)]);
        let takers = [big.needs.clone(), small.needs.clone(), small.needs.clone()];
        let used = used(&resources, takers.iter().map(Vec::as_slice));
        assert_eq!(used, [24, 1]);
        // fb: 40 left → 2 big (slots: 2 left → 2), 10 small.
        assert_eq!(available(&big, &resources, &used), 2);
        assert_eq!(available(&small, &resources, &used), 10);
        assert_eq!(available(&ty(&[]), &resources, &used), u64::MAX);
        assert_eq!(available(&ty(&[("nope", 1)]), &resources, &used), 0);
        assert!(shortfall(&big, &resources, &used).is_none());
    }

    #[test]
    fn test_shortfall_names_the_resource_that_ran_out() {
        let resources = [res("fb", 40), res("slots", 4)];
        let t = ty(&[("fb", 16), ("slots", 1)]);
        let used = used(&resources, [t.needs.as_slice(), t.needs.as_slice()]);
        // 8 MiB of framebuffer left is not nothing, but less than one instance needs.
        let (r, needed, left) = shortfall(&t, &resources, &used).unwrap();
        assert_eq!((r.name.as_str(), needed, left), ("fb", 16, 8));
        assert_eq!(available(&t, &resources, &used), 0);
        let slots_only = ty(&[("slots", 2)]);
        assert!(shortfall(&slots_only, &resources, &used).is_none());
        let used = self::used(&resources, [slots_only.needs.as_slice(); 2]);
        let (r, needed, left) = shortfall(&slots_only, &resources, &used).unwrap();
        assert_eq!((r.name.as_str(), needed, left), ("slots", 2, 0));
    }

    #[test]
    fn test_used_saturates_and_overcommitted_totals_leave_zero() {
        let resources = [res("fb", 10)];
        let huge = [("fb".to_string(), u64::MAX)];
        let used = used(&resources, [&huge[..], &huge[..]]);
        assert_eq!(used, [u64::MAX]);
        assert_eq!(available(&ty(&[("fb", 1)]), &resources, &used), 0);
    }
}
