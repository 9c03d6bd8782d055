package etcdsync

// The plan of a Shards (shards.go, shardsrun.go): the ordered view of its members and
// shard holders (shardsView, also read by ShardOwners), how many shards
// each member should hold (spread) and which free shards each member short
// of its share takes (picks). Pure functions of one view: every member
// computes the same plan.

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// shardPlan is this member's part of the plan for one view: how many shards
// it should hold, and the free shards it takes, in order.
type shardPlan struct {
	target int
	take   []int
}

// shardsView splits the keys of a Shards' view (inView), in join order,
// into its members and each shard's holder (by shard, 0 to n-1): the oldest
// key of the shard's lock; Held is false when it has none.
func shardsView(name string, n int, keys []Entry) (members, holder []Entry) {
	holder = make([]Entry, n)
	for _, e := range keys {
		dir, _, _ := strings.Cut(strings.TrimPrefix(e.Key, name+"/"), "/")
		if dir == "members" {
			members = append(members, e)
			continue
		}
		i, _ := strconv.Atoi(dir)
		if h := holder[i]; !h.Held || e.Rev < h.Rev {
			holder[i] = e
			holder[i].Held = true
		}
	}
	return members, holder
}

// ShardOwners returns, for each shard 0 to n-1 of name, its holder: its key,
// since which revision (Rev, the fencing token), its lease, and the value
// of the member with that lease (n, cap, host and pid of a Shards.Run); an
// Entry with Held false when nobody holds the shard. It needs no Session
// and joins nothing (for dashboards): one linearizable read through cli's
// KV, bounded by ctx. A nil client, n <= 0 or an invalid name is an error
// wrapping ErrInvalidArgument or ErrInvalidName.
func ShardOwners(ctx context.Context, cli *clientv3.Client, name string, n int) ([]Entry, error) {
	if err := checkGroup(cli, name); err != nil {
		return nil, err
	}
	if n <= 0 {
		return nil, fmt.Errorf("%w: shards %s: n = %d, want at least 1", ErrInvalidArgument, name, n)
	}
	resp, err := readGroup(ctx, cli, name+"/")
	if err != nil {
		return nil, fmt.Errorf("etcdsync: shards %s: %w", name, err)
	}
	members, holder := shardsView(name, n, keysIn(name+"/", resp.Kvs, (&Shards{name: name, n: n}).inView))
	out := make([]Entry, n)
	for i, h := range holder {
		if !h.Held {
			continue
		}
		h.Kind, h.Value = "exclusive", nil
		if j := slices.IndexFunc(members, func(m Entry) bool { return m.Lease == h.Lease }); j >= 0 {
			h.Value = members[j].Value
		}
		out[i] = h
	}
	return out, nil
}

// spread shares n over members with the caps (0: none), in join order: one
// at a time to each member with room, so that the members with room hold
// floor or ceil of their share, the oldest the ceil.
func spread(n int, caps []int) []int {
	t := make([]int, len(caps))
	for left := n; left > 0; {
		gave := false
		for j := range t {
			if left > 0 && (caps[j] == 0 || t[j] < caps[j]) {
				t[j]++
				left--
				gave = true
			}
		}
		if !gave {
			break
		}
	}
	return t
}

// picks returns the free shards member me takes: the free shards, in order,
// are dealt to the members short of their target, in join order, each its
// shortfall; every member computes the same deal from the same view.
func picks(free []int, targets, held []int, me int) []int {
	at := 0
	for j := range targets {
		short := max(0, targets[j]-held[j])
		if j == me {
			return free[min(at, len(free)):min(at+short, len(free))]
		}
		at += short
	}
	return nil
}
