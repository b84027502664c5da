//! Which CodeReady Builder repository goes with the enabled BaseOS.

use super::*;
use crate::install::test_machine::repolist;

#[test]
fn the_codeready_builder_that_goes_with_the_enabled_baseos() {
    let cases: &[(&[(&str, bool)], &str)] = &[
        (
            &[
                ("codeready-builder-for-rhel-9-x86_64-eus-rpms", false),
                ("codeready-builder-for-rhel-9-x86_64-rpms", false),
                ("codeready-builder-for-rhel-9-x86_64-source-rpms", false),
                ("rhel-9-for-x86_64-appstream-rpms", true),
                ("rhel-9-for-x86_64-baseos-eus-rpms", false),
                ("rhel-9-for-x86_64-baseos-rpms", true),
            ],
            "codeready-builder-for-rhel-9-x86_64-rpms",
        ),
        (
            &[
                ("codeready-builder-for-rhel-9-x86_64-eus-rpms", false),
                ("codeready-builder-for-rhel-9-x86_64-rpms", false),
                ("rhel-9-for-x86_64-baseos-eus-rpms", true),
                ("rhel-9-for-x86_64-baseos-rpms", false),
            ],
            "codeready-builder-for-rhel-9-x86_64-eus-rpms",
        ),
        (
            &[
                ("codeready-builder-for-rhel-9-rhui-debug-rpms", false),
                ("codeready-builder-for-rhel-9-rhui-rpms", false),
                ("rhel-9-appstream-rhui-rpms", true),
                ("rhel-9-baseos-rhui-rpms", true),
                ("rhui-client-config-server-9", true),
            ],
            "codeready-builder-for-rhel-9-rhui-rpms",
        ),
        (
            &[
                ("rhui-codeready-builder-for-rhel-9-x86_64-eus-rhui-rpms", false),
                ("rhui-codeready-builder-for-rhel-9-x86_64-rhui-rpms", false),
                ("rhui-rhel-9-for-x86_64-baseos-rhui-rpms", true),
            ],
            "rhui-codeready-builder-for-rhel-9-x86_64-rhui-rpms",
        ),
        (
            &[
                ("rhui-codeready-builder-for-rhel-9-x86_64-eus-rhui-rpms", false),
                ("rhui-codeready-builder-for-rhel-9-x86_64-rhui-rpms", false),
                ("rhui-rhel-9-for-x86_64-baseos-eus-rhui-rpms", true),
            ],
            "rhui-codeready-builder-for-rhel-9-x86_64-eus-rhui-rpms",
        ),
    ];
    for (repos, want) in cases {
        let parsed = parse_repolist(&repolist(repos));
        assert_eq!(parsed.len(), repos.len(), "every line read");
        assert_eq!(crb_repo(&parsed), Ok((want.to_string(), false)), "{repos:?}");
    }
    // Already on; none known; no BaseOS at all.
    let on = parse_repolist(&repolist(&[
        ("codeready-builder-for-rhel-9-x86_64-rpms", true),
        ("rhel-9-for-x86_64-baseos-rpms", true),
    ]));
    assert_eq!(crb_repo(&on), Ok(("codeready-builder-for-rhel-9-x86_64-rpms".into(), true)));
    let none = parse_repolist(&repolist(&[("rhel-9-for-x86_64-baseos-rpms", true)]));
    assert!(crb_repo(&none).unwrap_err().to_string().contains(
        "no CodeReady Builder repository goes with the enabled rhel-9-for-x86_64-baseos-rpms (dnf knows none)"
    ));
    assert!(crb_repo(&[]).unwrap_err().to_string().contains("no BaseOS repository is enabled"));
}
