package etcdtest

import (
	"context"
	"slices"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// Password is the password EnableAuth gives user.
func Password(user string) string { return user + "-password" }

// The roles EnableAuth knows: etcd's root, and read-write or read-only on
// the keys under locks/.
var authRoles = map[string]*clientv3.PermissionType{
	"root":     nil,
	"locks-rw": ptr(clientv3.PermissionType(clientv3.PermReadWrite)),
	"locks-ro": ptr(clientv3.PermissionType(clientv3.PermRead)),
}

func ptr[T any](v T) *T { return &v }

// EnableAuth adds, through admin, each user of grants (password:
// Password(user)) and the role grants gives it ("root", "locks-rw" or
// "locks-ro"; "" for none), then enables auth. It fails tb on an error.
func EnableAuth(tb TB, ctx context.Context, admin *clientv3.Client, grants map[string]string) {
	tb.Helper()
	var roles []string
	for user, role := range grants {
		if _, err := admin.UserAdd(ctx, user, Password(user)); err != nil {
			tb.Fatalf("etcdtest: add user %s: %v", user, err)
		}
		if role != "" && !slices.Contains(roles, role) {
			roles = append(roles, role)
		}
	}
	for _, role := range roles {
		perm, ok := authRoles[role]
		if !ok {
			tb.Fatalf("etcdtest: no role %q", role)
		}
		if _, err := admin.RoleAdd(ctx, role); err != nil {
			tb.Fatalf("etcdtest: add role %s: %v", role, err)
		}
		if perm != nil {
			if _, err := admin.RoleGrantPermission(ctx, role, "locks/", clientv3.GetPrefixRangeEnd("locks/"), *perm); err != nil {
				tb.Fatalf("etcdtest: grant %s: %v", role, err)
			}
		}
	}
	for user, role := range grants {
		if role == "" {
			continue
		}
		if _, err := admin.UserGrantRole(ctx, user, role); err != nil {
			tb.Fatalf("etcdtest: grant %s to %s: %v", role, user, err)
		}
	}
	if _, err := admin.AuthEnable(ctx); err != nil {
		tb.Fatalf("etcdtest: enable auth: %v", err)
	}
}
